"""The SPDK JSON config a DPU image loads at boot (`spdk_tgt --json FILE`).

Same shape as `rpc.py save_config` output (tests/data/spdk/save_config.json):
`{"subsystems": [{"subsystem": NAME, "config": [{"method": ..., "params": ...}]}]}`, with
the same ordering habits: crypto vbdevs before their base bdevs (SPDK defers them until the
base appears), `bdev_wait_for_examine` last in the bdev subsystem so lvols found on disk exist
before nvmf runs. Lvstores and lvols are not in it (they live on the drive, as in save_config),
so namespaces over lvol-backed bdevs are left to `apply` unless the drive is already
provisioned (`provisioned=True`): a boot config RPC that fails stops spdk_tgt from starting.
"""

from __future__ import annotations

from typing import Any

from spdk_plugins.calls import (
    Call,
    base_bdev_call,
    crypto_call,
    host_call,
    key_create_call,
    listener_call,
    mlx5_scan_call,
    ns_call,
    subsystem_call,
    transport_call,
)
from spdk_plugins.desired import KeyProvider, SpdkDesired, check_key_material
from spdk_plugins.rpc import REDACTED

__all__ = ["boot_config"]


def _entry(c: Call) -> dict[str, Any]:
    method, params = c
    return {"method": method, "params": params}


def boot_config(
    desired: SpdkDesired, key_provider: KeyProvider | None = None, *, provisioned: bool = False
) -> dict[str, Any]:
    """The boot JSON; without key_provider the key fields are `<redacted>` (for review)."""
    if key_provider is not None:
        check_key_material(desired, key_provider)
    return {
        "subsystems": [
            {"subsystem": "accel", "config": _accel(desired, key_provider)},
            {"subsystem": "bdev", "config": _bdev(desired)},
            {"subsystem": "nvmf", "config": _nvmf(desired, provisioned)},
        ]
    }


def _accel(d: SpdkDesired, key_provider: KeyProvider | None) -> list[dict[str, Any]]:
    out = [_entry(mlx5_scan_call(d.accel))] if d.accel.module == "mlx5" else []
    for k in d.keys:
        key, key2 = key_provider(k.name) if key_provider is not None else (REDACTED, REDACTED)
        out.append(_entry(key_create_call(k, key, key2)))
    return out


def _bdev(d: SpdkDesired) -> list[dict[str, Any]]:
    out = [_entry(crypto_call(c)) for c in d.crypto]
    out += [_entry(base_bdev_call(b)) for b in d.bdevs]
    out.append({"method": "bdev_wait_for_examine"})
    return out


def _on_lvol(d: SpdkDesired, bdev_name: str) -> bool:
    """Whether a bdev is an lvol or stacked on one (exists only once the lvstore does)."""
    lvols = {v.alias for v in d.lvols}
    crypto = {c.name: c.base_bdev_name for c in d.crypto}
    seen = 0
    while bdev_name in crypto and seen <= len(crypto):
        bdev_name, seen = crypto[bdev_name], seen + 1
    return bdev_name in lvols


def _nvmf(d: SpdkDesired, provisioned: bool) -> list[dict[str, Any]]:
    out = [_entry(transport_call(t)) for t in d.transports]
    for s in d.subsystems:
        out.append(_entry(subsystem_call(s)))
        out += [
            _entry(ns_call(s.nqn, ns))
            for ns in s.namespaces
            if provisioned or not _on_lvol(d, ns.bdev_name)
        ]
        out += [_entry(listener_call(s.nqn, x)) for x in s.listeners]
        out += [_entry(host_call(s.nqn, h)) for h in s.hosts]
    return out
