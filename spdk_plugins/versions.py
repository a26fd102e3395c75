"""Which SPDK releases the driver speaks, and the check made against a target at start.

The driver sends v26.05's method and parameter names (spdk_plugins.calls). Older releases
renamed or lacked some (DOCA images ship their own, older SPDK); a target whose release is not
in SUPPORTED_RELEASES, or that lacks a method the driver needs, is refused with a message that
names its version, instead of failing mid-plan on an unknown method or parameter.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from spdk_plugins.rpc import SpdkClient, SpdkError

__all__ = [
    "REQUIRED_METHODS",
    "SUPPORTED_RELEASES",
    "SpdkVersionError",
    "check_target_version",
    "recorded_release",
]

# (major, minor) -> release name; each has a recording in spdk_plugins/releases/<name>.json.
SUPPORTED_RELEASES: dict[tuple[int, int], str] = {(26, 5): "v26.05"}

# What every plan and apply sends whatever the config holds: bdevs, crypto, lvols and the
# NVMe-oF target. Methods only some configs need (aio, uring, mlx5 accel, framework_start_init)
# fail later with SPDK's own "Method not found", naming the method.
REQUIRED_METHODS = frozenset({
    "spdk_get_version",
    "rpc_get_methods",
    "framework_get_config",
    "bdev_get_bdevs",
    "bdev_wait_for_examine",
    "accel_crypto_key_create",
    "accel_crypto_keys_get",
    "bdev_crypto_create",
    "bdev_lvol_get_lvstores",
    "bdev_lvol_create_lvstore",
    "bdev_lvol_create",
    "nvmf_get_transports",
    "nvmf_create_transport",
    "nvmf_get_subsystems",
    "nvmf_create_subsystem",
    "nvmf_subsystem_add_ns",
    "nvmf_subsystem_add_listener",
    "nvmf_subsystem_add_host",
    "nvmf_subsystem_remove_host",
})  # fmt: skip


class SpdkVersionError(SpdkError):
    """The target is a release the driver does not speak, or lacks a method it needs."""


def recorded_release(name: str) -> dict[str, Any]:
    """The recording of a supported release: its version reply, methods and parameter names."""
    text = resources.files("spdk_plugins.releases").joinpath(f"{name}.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def _supported() -> str:
    return ", ".join(SUPPORTED_RELEASES.values())


def check_target_version(client: SpdkClient) -> str:
    """The target's release name; SpdkVersionError when the driver does not speak it."""
    reply = client.spdk_get_version()
    fields = reply.get("fields") if isinstance(reply, dict) else None
    text = str(reply.get("version", "?"))[:80] if isinstance(reply, dict) else "?"
    try:
        major, minor = int(fields["major"]), int(fields["minor"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise SpdkVersionError(
            f"SPDK answered spdk_get_version without a version ({text}); the driver speaks "
            f"{_supported()}"
        ) from None
    release = SUPPORTED_RELEASES.get((major, minor))
    if release is None:
        raise SpdkVersionError(
            f"SPDK {text} is not a release the driver speaks ({_supported()}): its RPC method "
            f"or parameter names differ; run the SPDK the driver supports (docs/SPDK.md "
            f'"Versions"), not the DOCA image\'s'
        )
    missing = REQUIRED_METHODS - set(client.rpc_get_methods())
    if missing:
        raise SpdkVersionError(
            f"SPDK {text} lacks RPC methods the driver needs: {', '.join(sorted(missing))} "
            "(built without them?)"
        )
    return release
