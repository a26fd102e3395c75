"""The SPDK JSON config a DPU image loads at boot (`spdk_tgt --json FILE`).

Same shape as `rpc.py save_config` output (shared/spdk/save_config.json):
`{"subsystems": [{"subsystem": NAME, "config": [{"method": ..., "params": ...}]}]}`, with
the same ordering habits: crypto vbdevs before their base bdevs (SPDK defers them until the
base appears), `bdev_wait_for_examine` last in the bdev subsystem so lvols found on disk exist
before nvmf runs. Lvstores and lvols are not in it (they live on the drive, as in save_config),
so namespaces over lvol-backed bdevs are left to `apply` unless the drive is already
provisioned (`provisioned=True`): a boot config RPC that fails stops spdk_tgt from starting.
"""

from __future__ import annotations

from typing import Any

from spdk_plugins.desired import (
    AioBdev,
    KeyProvider,
    MallocBdev,
    NvmeBdev,
    SpdkDesired,
    UringBdev,
    check_key_material,
)
from spdk_plugins.rpc import REDACTED

__all__ = ["boot_config"]


def _entry(method: str, **params: Any) -> dict[str, Any]:
    return {"method": method, "params": {k: v for k, v in params.items() if v is not None}}


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
    out = []
    if d.accel.module == "mlx5":
        a = d.accel
        devs = ",".join(a.allowed_devs) if a.allowed_devs else None
        out.append(
            _entry(
                "mlx5_scan_accel_module",
                qp_size=a.qp_size,
                num_requests=a.num_requests,
                allowed_devs=devs,
                crypto_split_blocks=a.crypto_split_blocks,
                enable_driver=a.enable_driver,
            )
        )
    for k in d.keys:
        key, key2 = key_provider(k.name) if key_provider is not None else (REDACTED, REDACTED)
        out.append(
            _entry(
                "accel_crypto_key_create",
                name=k.name,
                cipher=k.cipher,
                key=key,
                key2=key2,
                tweak_mode=k.tweak_mode,
            )
        )
    return out


def _bdev(d: SpdkDesired) -> list[dict[str, Any]]:
    out = [
        _entry(
            "bdev_crypto_create", base_bdev_name=c.base_bdev_name, name=c.name, key_name=c.key_name
        )
        for c in d.crypto
    ]
    for b in d.bdevs:
        if isinstance(b, NvmeBdev):
            out.append(
                _entry(
                    "bdev_nvme_attach_controller",
                    name=b.name,
                    trtype=b.trtype,
                    traddr=b.traddr,
                    adrfam=b.adrfam,
                    trsvcid=b.trsvcid,
                    subnqn=b.subnqn,
                    hostnqn=b.hostnqn,
                )
            )
        elif isinstance(b, MallocBdev):
            out.append(
                _entry(
                    "bdev_malloc_create",
                    name=b.name,
                    num_blocks=b.num_blocks,
                    block_size=b.block_size,
                    uuid=b.uuid,
                )
            )
        elif isinstance(b, AioBdev):
            out.append(
                _entry(
                    "bdev_aio_create",
                    name=b.name,
                    filename=b.filename,
                    block_size=b.block_size,
                    readonly=b.readonly,
                )
            )
        elif isinstance(b, UringBdev):
            out.append(
                _entry(
                    "bdev_uring_create", name=b.name, filename=b.filename, block_size=b.block_size
                )
            )
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
    out = [_entry("nvmf_create_transport", trtype=t.trtype, **dict(t.tuning)) for t in d.transports]
    for s in d.subsystems:
        out.append(
            _entry(
                "nvmf_create_subsystem",
                nqn=s.nqn,
                allow_any_host=s.allow_any_host,
                serial_number=s.serial_number,
                model_number=s.model_number,
                max_namespaces=s.max_namespaces,
            )
        )
        for ns in s.namespaces:
            if provisioned or not _on_lvol(d, ns.bdev_name):
                out.append(
                    _entry(
                        "nvmf_subsystem_add_ns",
                        nqn=s.nqn,
                        namespace={"nsid": ns.nsid, "bdev_name": ns.bdev_name},
                    )
                )
        for x in s.listeners:
            out.append(_entry("nvmf_subsystem_add_listener", nqn=s.nqn, listen_address=x.address()))
        for h in s.hosts:
            out.append(_entry("nvmf_subsystem_add_host", nqn=s.nqn, host=h))
    return out
