"""The RPC that creates each desired object: one place for what `plan` and the boot config send.

Each function returns `(method, params)` with SPDK's parameter names and `None` fields
omitted (the only place that decides omission), so a field added to a desired object is added
to both the reconciling plan and the boot JSON at once.
"""

from __future__ import annotations

from typing import Any

from spdk_plugins._omit import omit_none
from spdk_plugins.desired import (
    AccelConfig,
    AioBdev,
    CryptoBdev,
    KeyConfig,
    Listener,
    Lvol,
    Lvstore,
    MallocBdev,
    Namespace,
    NvmeBdev,
    Subsystem,
    Transport,
    UringBdev,
)

__all__ = [
    "Call",
    "base_bdev_call",
    "call",
    "crypto_call",
    "host_call",
    "key_create_call",
    "listener_call",
    "lvol_call",
    "lvstore_call",
    "mlx5_scan_call",
    "ns_call",
    "subsystem_call",
    "transport_call",
]

Call = tuple[str, dict[str, Any]]


def call(method: str, **params: Any) -> Call:
    """A call with the `None` parameters left out (SPDK's `None` = omit)."""
    return method, omit_none(**params)


def mlx5_scan_call(a: AccelConfig) -> Call:
    devs = ",".join(a.allowed_devs) if a.allowed_devs else None
    return call(
        "mlx5_scan_accel_module",
        qp_size=a.qp_size,
        num_requests=a.num_requests,
        allowed_devs=devs,
        crypto_split_blocks=a.crypto_split_blocks,
        enable_driver=a.enable_driver,
    )


def key_create_call(k: KeyConfig, key: str, key2: str) -> Call:
    """`key`/`key2` are hex material, or `<redacted>` in anything shown to a person."""
    return call(
        "accel_crypto_key_create",
        name=k.name,
        cipher=k.cipher,
        key=key,
        key2=key2,
        tweak_mode=k.tweak_mode,
    )


def base_bdev_call(b: NvmeBdev | MallocBdev | AioBdev | UringBdev) -> Call:
    if isinstance(b, NvmeBdev):
        return call(
            "bdev_nvme_attach_controller",
            name=b.name,
            trtype=b.trtype,
            traddr=b.traddr,
            adrfam=b.adrfam,
            trsvcid=b.trsvcid,
            subnqn=b.subnqn,
            hostnqn=b.hostnqn,
        )
    if isinstance(b, MallocBdev):
        return call(
            "bdev_malloc_create",
            name=b.name,
            num_blocks=b.num_blocks,
            block_size=b.block_size,
            uuid=b.uuid,
        )
    if isinstance(b, AioBdev):
        return call(
            "bdev_aio_create",
            name=b.name,
            filename=b.filename,
            block_size=b.block_size,
            readonly=b.readonly,
        )
    return call("bdev_uring_create", name=b.name, filename=b.filename, block_size=b.block_size)


def crypto_call(c: CryptoBdev) -> Call:
    return call(
        "bdev_crypto_create", base_bdev_name=c.base_bdev_name, name=c.name, key_name=c.key_name
    )


def lvstore_call(s: Lvstore) -> Call:
    return call(
        "bdev_lvol_create_lvstore",
        bdev_name=s.bdev_name,
        lvs_name=s.lvs_name,
        cluster_sz=s.cluster_sz,
        clear_method=s.clear_method,
    )


def lvol_call(v: Lvol) -> Call:
    return call(
        "bdev_lvol_create",
        lvol_name=v.lvol_name,
        size_in_mib=v.size_in_mib,
        thin_provision=v.thin_provision,
        lvs_name=v.lvs_name,
        clear_method=v.clear_method,
    )


def transport_call(t: Transport) -> Call:
    return call("nvmf_create_transport", trtype=t.trtype, **dict(t.tuning))


def subsystem_call(s: Subsystem) -> Call:
    return call(
        "nvmf_create_subsystem",
        nqn=s.nqn,
        allow_any_host=s.allow_any_host,
        serial_number=s.serial_number,
        model_number=s.model_number,
        max_namespaces=s.max_namespaces,
    )


def ns_call(nqn: str, ns: Namespace) -> Call:
    return call(
        "nvmf_subsystem_add_ns", nqn=nqn, namespace={"nsid": ns.nsid, "bdev_name": ns.bdev_name}
    )


def listener_call(nqn: str, x: Listener) -> Call:
    return call("nvmf_subsystem_add_listener", nqn=nqn, listen_address=x.address())


def host_call(nqn: str, host: str) -> Call:
    return call("nvmf_subsystem_add_host", nqn=nqn, host=host)
