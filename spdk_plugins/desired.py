"""The desired SPDK state: the `[spdk]` section of the agent's TOML config, parsed and checked.

Field names are SPDK's RPC parameter names verbatim, so a reader of the SPDK docs recognises
them. Everything is validated when loaded and a bad value is refused with the dotted path of
the field (`spdk.subsystems[1].namespaces[0].bdev_name`). Key material never appears here:
`[[spdk.keys]]` names a key, and the agent's key store supplies it (`KeyProvider`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvproto.tomlfile import CONFIG_BYTES_MAX, TomlFileError, load_toml

__all__ = [
    "AccelConfig",
    "AioBdev",
    "BaseBdev",
    "CryptoBdev",
    "DesiredStateError",
    "KeyConfig",
    "KeyProvider",
    "Listener",
    "Lvol",
    "Lvstore",
    "MallocBdev",
    "Namespace",
    "NvmeBdev",
    "SpdkDesired",
    "Subsystem",
    "Transport",
    "UringBdev",
    "check_key_material",
    "load_desired",
    "parse_desired",
]

# key name -> (key hex, key2 hex). Injected: the agent's key store, never the TOML.
KeyProvider = Callable[[str], tuple[str, str]]

NQN_BYTES_MAX = 223  # NVMe base spec: NQNs are at most 223 bytes
SERIAL_NUMBER_CHARS_MAX = 20  # Identify Controller SN field
MODEL_NUMBER_CHARS_MAX = 40  # Identify Controller MN field
NSID_MAX = 0xFFFFFFFE
# Bounds a config's size (and so a plan's length): a DPU serves tens of tenants, not thousands.
OBJECTS_PER_KIND_MAX = 1024
TWEAK_MODES = ("SIMPLE_LBA", "JOIN_NEG_LBA_WITH_LBA", "INCR_512_FULL_LBA", "INCR_512_UPPER_LBA")
CIPHERS = ("AES_XTS",)  # the project encrypts with AES-XTS only (DESIGN.md)
# Bytes of each of the two AES keys of an accel_crypto_key (key and key2), as SPDK takes them
# (not the 64-byte key || key2 of dpu_agent.crypto.keystore.XTS_KEY_BYTES)
MLX5_KEY_HALF_BYTES_ALLOWED = (16, 32)
XTS_KEY_HALF_BYTES_ALLOWED = (16, 32)
_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]*$")

# nvmf_create_transport tuning parameters, by SPDK name, with their JSON type.
_TRANSPORT_COMMON: dict[str, type] = {
    "max_queue_depth": int,
    "max_io_qpairs_per_ctrlr": int,
    "in_capsule_data_size": int,
    "max_io_size": int,
    "io_unit_size": int,
    "max_aq_depth": int,
    "num_shared_buffers": int,
    "buf_cache_size": int,
    "iobuf_small_cache_size": int,
    "iobuf_large_cache_size": int,
    "zcopy": bool,
    "dif_insert_or_strip": bool,
    "abort_timeout_sec": int,
    "acceptor_poll_rate": int,
    "disable_command_passthru": bool,
    "kas": int,
    "min_kato": int,
}
TRANSPORT_TUNING: dict[str, dict[str, type]] = {
    "TCP": {
        **_TRANSPORT_COMMON,
        "c2h_success": bool,
        "sock_priority": int,
        "control_msg_num": int,
    },
    "RDMA": {
        **_TRANSPORT_COMMON,
        "num_cqe": int,
        "max_srq_depth": int,
        "no_srq": bool,
        "acceptor_backlog": int,
        "no_wr_batching": bool,
        "ack_timeout": int,
        "data_wr_pool_size": int,
    },
}


class DesiredStateError(ValueError):
    """A bad desired state; `field` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AccelConfig:
    module: Literal["software", "mlx5"] = "software"
    qp_size: int | None = None
    num_requests: int | None = None
    allowed_devs: tuple[str, ...] = ()
    crypto_split_blocks: int | None = None
    enable_driver: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyConfig:
    name: str
    tenant: str | None = None  # whose key in the agent's key store (default: the key's name)
    cipher: str = "AES_XTS"
    tweak_mode: str = "SIMPLE_LBA"


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmeBdev:
    """A controller: PCIe (a local drive by BDF) or NVMe-oF (tcp/rdma). Its bdevs are NAMEn1.."""

    name: str
    trtype: str
    traddr: str
    adrfam: str | None = None
    trsvcid: str | None = None
    subnqn: str | None = None
    hostnqn: str | None = None
    num_namespaces: int = 1

    @property
    def bdev_names(self) -> tuple[str, ...]:
        return tuple(f"{self.name}n{i}" for i in range(1, self.num_namespaces + 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class MallocBdev:
    name: str
    block_size: int
    num_blocks: int
    uuid: str | None = None

    @property
    def bdev_names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True, kw_only=True)
class AioBdev:
    name: str
    filename: str
    block_size: int | None = None
    readonly: bool | None = None

    @property
    def bdev_names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True, kw_only=True)
class UringBdev:
    name: str
    filename: str
    block_size: int | None = None

    @property
    def bdev_names(self) -> tuple[str, ...]:
        return (self.name,)


BaseBdev = NvmeBdev | MallocBdev | AioBdev | UringBdev


@dataclass(frozen=True, slots=True, kw_only=True)
class CryptoBdev:
    name: str
    base_bdev_name: str
    key_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Lvstore:
    lvs_name: str
    bdev_name: str
    cluster_sz: int | None = None
    clear_method: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lvol:
    lvs_name: str
    lvol_name: str
    size_in_mib: int
    thin_provision: bool = False
    clear_method: str | None = None

    @property
    def alias(self) -> str:
        return f"{self.lvs_name}/{self.lvol_name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Transport:
    trtype: str
    tuning: tuple[tuple[str, int | bool], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    nsid: int
    bdev_name: str
    tier: str | None = None  # "dram" or "nvme": an agent tier reached over NVMe/TCP


@dataclass(frozen=True, slots=True, kw_only=True)
class Listener:
    trtype: str
    traddr: str
    trsvcid: str
    adrfam: str = "IPv4"

    def address(self) -> dict[str, str]:
        return {
            "trtype": self.trtype,
            "adrfam": self.adrfam,
            "traddr": self.traddr,
            "trsvcid": self.trsvcid,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Subsystem:
    nqn: str
    tenant: str | None = None
    serial_number: str | None = None
    model_number: str | None = None
    max_namespaces: int | None = None
    allow_any_host: bool = False
    hosts: tuple[str, ...] = ()
    namespaces: tuple[Namespace, ...] = ()
    listeners: tuple[Listener, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SpdkDesired:
    socket: str = "/var/tmp/spdk.sock"
    rpc_timeout_s: float = 60.0
    prune: bool = False
    agent_hostnqn: str | None = None
    accel: AccelConfig = field(default_factory=AccelConfig)
    keys: tuple[KeyConfig, ...] = ()
    bdevs: tuple[BaseBdev, ...] = ()
    crypto: tuple[CryptoBdev, ...] = ()
    lvstores: tuple[Lvstore, ...] = ()
    lvols: tuple[Lvol, ...] = ()
    transports: tuple[Transport, ...] = ()
    subsystems: tuple[Subsystem, ...] = ()

    def bdev_names(self) -> dict[str, str]:
        """Every bdev name the desired state produces -> the field that declares it."""
        names: dict[str, str] = {}
        for i, b in enumerate(self.bdevs):
            for n in b.bdev_names:
                names[n] = f"spdk.bdevs[{i}]"
        for i, c in enumerate(self.crypto):
            names[c.name] = f"spdk.crypto[{i}]"
        for i, lv in enumerate(self.lvols):
            names[lv.alias] = f"spdk.lvols[{i}]"
        return names


# ------------------------------------------------------------------ TOML reading


class _Table:
    """One TOML table being read: typed accessors that name the field, and no unknown keys."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, dict):
            raise DesiredStateError(path, f"expected a table, got {type(raw).__name__}")
        self.raw = raw
        self.path = path
        self.used: set[str] = set()

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(name)
        if name not in self.raw:
            return default
        value = self.raw[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise DesiredStateError(f"{self.path}.{name}", f"expected {_kname(kinds)}, got bool")
        if int in kinds and float in kinds and isinstance(value, int):
            return value
        if not isinstance(value, kinds):
            raise DesiredStateError(
                f"{self.path}.{name}", f"expected {_kname(kinds)}, got {type(value).__name__}"
            )
        return value

    def req(self, name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in self.raw:
            raise DesiredStateError(f"{self.path}.{name}", "required field missing")
        return self.get(name, kind)

    def name(self, key: str, required: bool = True) -> Any:
        value = self.req(key, str) if required else self.get(key, str)
        if value is not None and not _NAME_RE.match(value):
            raise DesiredStateError(
                f"{self.path}.{key}", f"{value!r} is not a name (1-64 of A-Z a-z 0-9 _ . : -)"
            )
        return value

    def positive(self, name: str, required: bool = False, maximum: int = 2**64 - 1) -> Any:
        value = self.req(name, int) if required else self.get(name, int)
        if value is not None and not 0 < value <= maximum:
            raise DesiredStateError(f"{self.path}.{name}", f"{value} not in [1, {maximum}]")
        return value

    def tables(self, name: str) -> list[_Table]:
        items = self.get(name, list, [])
        if len(items) > OBJECTS_PER_KIND_MAX:
            raise DesiredStateError(
                f"{self.path}.{name}", f"{len(items)} entries > {OBJECTS_PER_KIND_MAX}"
            )
        return [_Table(item, f"{self.path}.{name}[{i}]") for i, item in enumerate(items)]

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise DesiredStateError(
                f"{self.path}.{unknown[0]}",
                f"unknown field (known: {', '.join(sorted(self.used))})",
            )


def _kname(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _choice(t: _Table, name: str, choices: tuple[str, ...], default: str | None) -> Any:
    value = t.get(name, str, default)
    if value is not None and value not in choices:
        raise DesiredStateError(f"{t.path}.{name}", f"{value!r} not one of {', '.join(choices)}")
    return value


def load_desired(path: str | Path) -> SpdkDesired:
    """Read the agent config file and parse its `[spdk]` section."""
    try:
        doc = load_toml(path, max_bytes=CONFIG_BYTES_MAX)
    except TomlFileError as e:
        raise DesiredStateError("spdk", str(e)) from None
    return parse_desired(doc)


def parse_desired(doc: dict[str, Any]) -> SpdkDesired:
    """Parse a whole config document (with an `spdk` table) and validate cross-references."""
    if "spdk" not in doc:
        raise DesiredStateError("spdk", "no [spdk] section in the config")
    t = _Table(doc["spdk"], "spdk")
    timeout = float(t.get("rpc_timeout_s", (int, float), 60.0))
    if not 0 < timeout <= 600:
        raise DesiredStateError("spdk.rpc_timeout_s", f"{timeout} not in (0, 600]")
    desired = SpdkDesired(
        socket=t.get("socket", str, "/var/tmp/spdk.sock"),
        rpc_timeout_s=timeout,
        prune=t.get("prune", bool, False),
        agent_hostnqn=t.get("agent_hostnqn", str),
        accel=_parse_accel(t),
        keys=tuple(_parse_key(k) for k in t.tables("keys")),
        bdevs=tuple(_parse_bdev(b) for b in t.tables("bdevs")),
        crypto=tuple(_parse_crypto(c) for c in t.tables("crypto")),
        lvstores=tuple(_parse_lvstore(s) for s in t.tables("lvstores")),
        lvols=tuple(_parse_lvol(v) for v in t.tables("lvols")),
        transports=tuple(_parse_transport(x) for x in t.tables("transports")),
        subsystems=tuple(_parse_subsystem(s) for s in t.tables("subsystems")),
    )
    t.done()
    _check_references(desired)
    return desired


def _parse_accel(parent: _Table) -> AccelConfig:
    if "accel" not in parent.raw:
        parent.used.add("accel")
        return AccelConfig()
    t = _Table(parent.get("accel", dict), "spdk.accel")
    module = _choice(t, "module", ("software", "mlx5"), "software")
    devs = t.get("allowed_devs", list, [])
    for i, d in enumerate(devs):
        if not isinstance(d, str) or not _NAME_RE.match(d):
            raise DesiredStateError(f"spdk.accel.allowed_devs[{i}]", f"{d!r} is not a device name")
    split = t.get("crypto_split_blocks", int)
    if split is not None and not 0 <= split <= 0xFFFF:  # SPDK decodes it as uint16; 0 = no limit
        raise DesiredStateError("spdk.accel.crypto_split_blocks", f"{split} not in [0, 65535]")
    acc = AccelConfig(
        module=module,
        qp_size=t.positive("qp_size", maximum=0xFFFF),
        num_requests=t.positive("num_requests", maximum=0xFFFFFFFF),
        allowed_devs=tuple(devs),
        crypto_split_blocks=split,
        enable_driver=t.get("enable_driver", bool),
    )
    t.done()
    if module == "software" and (devs or acc.qp_size or acc.num_requests):
        raise DesiredStateError("spdk.accel.module", "mlx5 options given with module 'software'")
    return acc


def _parse_key(t: _Table) -> KeyConfig:
    key = KeyConfig(
        name=t.name("name"),
        tenant=t.name("tenant", required=False),
        cipher=_choice(t, "cipher", CIPHERS, "AES_XTS"),
        tweak_mode=_choice(t, "tweak_mode", TWEAK_MODES, "SIMPLE_LBA"),
    )
    for secret in ("key", "key2"):
        if secret in t.raw:
            raise DesiredStateError(
                f"{t.path}.{secret}",
                "key material does not belong in the config; the agent's key store supplies it",
            )
    t.done()
    return key


def _parse_bdev(t: _Table) -> BaseBdev:
    kind = _choice(t, "type", ("nvme", "malloc", "aio", "uring"), None)
    if kind is None:
        raise DesiredStateError(f"{t.path}.type", "required field missing (nvme|malloc|aio|uring)")
    bdev: BaseBdev
    if kind == "nvme":
        bdev = NvmeBdev(
            name=t.name("name"),
            trtype=_choice(t, "trtype", ("PCIe", "TCP", "RDMA"), "PCIe"),
            traddr=t.req("traddr", str),
            adrfam=t.get("adrfam", str),
            trsvcid=t.get("trsvcid", str),
            subnqn=t.get("subnqn", str),
            hostnqn=t.get("hostnqn", str),
            num_namespaces=t.positive("num_namespaces", maximum=1024) or 1,
        )
        if bdev.trtype != "PCIe" and (bdev.subnqn is None or bdev.trsvcid is None):
            raise DesiredStateError(f"{t.path}.subnqn", "NVMe-oF attach needs subnqn and trsvcid")
    elif kind == "malloc":
        bdev = MallocBdev(
            name=t.name("name"),
            block_size=_block_size(t, required=True),
            num_blocks=t.positive("num_blocks", required=True),
            uuid=_uuid(t, "uuid"),
        )
    elif kind == "aio":
        bdev = AioBdev(
            name=t.name("name"),
            filename=t.req("filename", str),
            block_size=_block_size(t),
            readonly=t.get("readonly", bool),
        )
    else:
        bdev = UringBdev(
            name=t.name("name"), filename=t.req("filename", str), block_size=_block_size(t)
        )
    t.done()
    return bdev


def _block_size(t: _Table, required: bool = False) -> Any:
    value = t.positive("block_size", required=required, maximum=65536)
    if value is not None and value % 512:
        raise DesiredStateError(f"{t.path}.block_size", f"{value} is not a multiple of 512")
    return value


def _uuid(t: _Table, name: str) -> Any:
    value = t.get(name, str)
    if value is not None and not _UUID_RE.match(value):
        raise DesiredStateError(f"{t.path}.{name}", f"{value!r} is not a lowercase UUID")
    return value


def _parse_crypto(t: _Table) -> CryptoBdev:
    c = CryptoBdev(
        name=t.name("name"),
        base_bdev_name=t.req("base_bdev_name", str),
        key_name=t.name("key_name"),
    )
    t.done()
    return c


def _parse_lvstore(t: _Table) -> Lvstore:
    s = Lvstore(
        lvs_name=t.name("lvs_name"),
        bdev_name=t.req("bdev_name", str),
        cluster_sz=t.positive("cluster_sz", maximum=2**32 - 1),
        clear_method=_choice(t, "clear_method", ("none", "unmap", "write_zeroes"), None),
    )
    t.done()
    return s


def _parse_lvol(t: _Table) -> Lvol:
    v = Lvol(
        lvs_name=t.name("lvs_name"),
        lvol_name=t.name("lvol_name"),
        size_in_mib=t.positive("size_in_mib", required=True),
        thin_provision=t.get("thin_provision", bool, False),
        clear_method=_choice(t, "clear_method", ("none", "unmap", "write_zeroes"), None),
    )
    t.done()
    return v


def _parse_transport(t: _Table) -> Transport:
    trtype = _choice(t, "trtype", ("TCP", "RDMA"), None)
    if trtype is None:
        raise DesiredStateError(f"{t.path}.trtype", "required field missing (TCP|RDMA)")
    allowed = TRANSPORT_TUNING[trtype]
    tuning: list[tuple[str, int | bool]] = []
    for name in sorted(set(t.raw) - {"trtype"}):
        if name not in allowed:
            raise DesiredStateError(
                f"{t.path}.{name}", f"not a {trtype} transport parameter of SPDK v26.05"
            )
        value = t.req(name, allowed[name])
        if allowed[name] is int and value < 0:
            raise DesiredStateError(f"{t.path}.{name}", f"{value} is negative")
        tuning.append((name, value))
    t.done()
    return Transport(trtype=trtype, tuning=tuple(tuning))


def _parse_subsystem(t: _Table) -> Subsystem:
    nqn = t.req("nqn", str)
    if not nqn.startswith("nqn.") or len(nqn.encode()) > NQN_BYTES_MAX:
        raise DesiredStateError(f"{t.path}.nqn", f"{nqn!r} is not an NQN (nqn.*, <= 223 bytes)")
    hosts = t.get("hosts", list, [])
    for i, h in enumerate(hosts):
        if not isinstance(h, str) or not h.startswith("nqn."):
            raise DesiredStateError(f"{t.path}.hosts[{i}]", f"{h!r} is not a host NQN")
    namespaces = tuple(_parse_namespace(n) for n in t.tables("namespaces"))
    listeners = tuple(_parse_listener(x) for x in t.tables("listeners"))
    sub_ = Subsystem(
        nqn=nqn,
        tenant=t.name("tenant", required=False),
        serial_number=_bounded_str(t, "serial_number", SERIAL_NUMBER_CHARS_MAX),
        model_number=_bounded_str(t, "model_number", MODEL_NUMBER_CHARS_MAX),
        max_namespaces=t.positive("max_namespaces", maximum=0xFFFFFFFF),
        allow_any_host=t.get("allow_any_host", bool, False),
        hosts=tuple(hosts),
        namespaces=namespaces,
        listeners=listeners,
    )
    t.done()
    if not sub_.allow_any_host and not sub_.hosts:
        raise DesiredStateError(
            f"{t.path}.hosts",
            "empty with allow_any_host = false: no host could connect; list host NQNs "
            "(or set allow_any_host = true, which exposes the subsystem to every host)",
        )
    return sub_


def _parse_namespace(n: _Table) -> Namespace:
    ns = Namespace(
        nsid=n.positive("nsid", required=True, maximum=NSID_MAX),
        bdev_name=n.req("bdev_name", str),
        tier=_choice(n, "tier", ("dram", "nvme"), None),
    )
    n.done()
    return ns


def _parse_listener(x: _Table) -> Listener:
    lis = Listener(
        trtype=_choice(x, "trtype", ("TCP", "RDMA"), "TCP"),
        adrfam=_choice(x, "adrfam", ("IPv4", "IPv6"), "IPv4"),
        traddr=x.req("traddr", str),
        trsvcid=str(x.req("trsvcid", (str, int))),
    )
    x.done()
    return lis


def _bounded_str(t: _Table, name: str, chars_max: int) -> Any:
    value = t.get(name, str)
    if value is not None and not 0 < len(value) <= chars_max:
        raise DesiredStateError(f"{t.path}.{name}", f"{value!r} is longer than {chars_max}")
    return value


def _unique(items: list[tuple[str, str]], what: str) -> None:
    seen: dict[str, str] = {}
    for key, path in items:
        if key in seen:
            raise DesiredStateError(path, f"duplicate {what} {key!r} (also at {seen[key]})")
        seen[key] = path


def _check_references(d: SpdkDesired) -> None:
    """Cross-field checks: every reference resolves, nothing is declared or claimed twice."""
    _unique([(k.name, f"spdk.keys[{i}].name") for i, k in enumerate(d.keys)], "key name")
    names: list[tuple[str, str]] = []
    for i, b in enumerate(d.bdevs):
        names += [(n, f"spdk.bdevs[{i}].name") for n in b.bdev_names]
    names += [(c.name, f"spdk.crypto[{i}].name") for i, c in enumerate(d.crypto)]
    names += [(v.alias, f"spdk.lvols[{i}].lvol_name") for i, v in enumerate(d.lvols)]
    _unique(names, "bdev name")
    _unique(
        [(s.lvs_name, f"spdk.lvstores[{i}].lvs_name") for i, s in enumerate(d.lvstores)], "lvstore"
    )
    _unique(
        [(x.trtype, f"spdk.transports[{i}].trtype") for i, x in enumerate(d.transports)],
        "transport",
    )
    _unique([(s.nqn, f"spdk.subsystems[{i}].nqn") for i, s in enumerate(d.subsystems)], "NQN")
    known = d.bdev_names()
    key_names = {k.name for k in d.keys}
    claims: list[tuple[str, str]] = []
    if d.accel.module == "mlx5":
        for i, k in enumerate(d.keys):
            if k.tweak_mode != "SIMPLE_LBA":
                raise DesiredStateError(
                    f"spdk.keys[{i}].tweak_mode",
                    f"{k.tweak_mode!r}: the mlx5 accel module supports only SIMPLE_LBA",
                )
    lvs_names = {s.lvs_name for s in d.lvstores}
    for i, v in enumerate(d.lvols):
        if v.lvs_name not in lvs_names:
            raise DesiredStateError(f"spdk.lvols[{i}].lvs_name", f"unknown lvstore {v.lvs_name!r}")
    for i, c in enumerate(d.crypto):
        if c.key_name not in key_names:
            raise DesiredStateError(
                f"spdk.crypto[{i}].key_name", f"unknown key {c.key_name!r}; declare it in spdk.keys"
            )
        _known(known, c.base_bdev_name, f"spdk.crypto[{i}].base_bdev_name")
        claims.append((c.base_bdev_name, f"spdk.crypto[{i}].base_bdev_name"))
    for i, store in enumerate(d.lvstores):
        _known(known, store.bdev_name, f"spdk.lvstores[{i}].bdev_name")
        claims.append((store.bdev_name, f"spdk.lvstores[{i}].bdev_name"))
    trtypes = {x.trtype for x in d.transports}
    for i, sub in enumerate(d.subsystems):
        p = f"spdk.subsystems[{i}]"
        _unique(
            [(str(n.nsid), f"{p}.namespaces[{j}].nsid") for j, n in enumerate(sub.namespaces)],
            "nsid",
        )
        _unique([(h, f"{p}.hosts[{j}]") for j, h in enumerate(sub.hosts)], "host")
        for j, n in enumerate(sub.namespaces):
            _known(known, n.bdev_name, f"{p}.namespaces[{j}].bdev_name")
            claims.append((n.bdev_name, f"{p}.namespaces[{j}].bdev_name"))
        for j, x in enumerate(sub.listeners):
            if x.trtype not in trtypes:
                raise DesiredStateError(
                    f"{p}.listeners[{j}].trtype", f"no {x.trtype} transport in spdk.transports"
                )
        if sub.max_namespaces is not None and len(sub.namespaces) > sub.max_namespaces:
            raise DesiredStateError(f"{p}.max_namespaces", "fewer than the namespaces listed")
    _unique(claims, "use of bdev (a bdev is claimed by one user only)")
    _check_acyclic(d)


def _check_acyclic(d: SpdkDesired) -> None:
    """A crypto vbdev must not sit, through any chain, on itself."""
    parent = {c.name: c.base_bdev_name for c in d.crypto}
    parent.update({"lvs:" + s.lvs_name: s.bdev_name for s in d.lvstores})
    parent.update({v.alias: "lvs:" + v.lvs_name for v in d.lvols})
    for i, c in enumerate(d.crypto):
        cur, hops = c.base_bdev_name, 0
        while cur in parent and hops <= len(parent):
            if cur == c.name:
                raise DesiredStateError(f"spdk.crypto[{i}].base_bdev_name", "sits on itself")
            cur, hops = parent[cur], hops + 1


def _known(known: dict[str, str], name: str, path: str) -> None:
    if name not in known:
        raise DesiredStateError(
            path, f"bdev {name!r} is not declared (known: {', '.join(sorted(known)) or 'none'})"
        )


def check_key_material(desired: SpdkDesired, key_provider: KeyProvider) -> None:
    """Fetch each key from the key store and check it; messages never contain the material."""
    for i, k in enumerate(desired.keys):
        path = f"spdk.keys[{i}]"
        try:
            key, key2 = key_provider(k.name)
        except KeyError as e:
            raise DesiredStateError(path, f"key {k.name!r} not in the key store") from e
        for label, value in (("key", key), ("key2", key2)):
            if (
                not isinstance(value, str)
                or not value
                or len(value) % 2
                or not _HEX_RE.match(value)
            ):
                raise DesiredStateError(f"{path}.{label}", "key store value is not even-length hex")
        if len(key) != len(key2):
            raise DesiredStateError(f"{path}.key2", "key and key2 differ in length")
        if key.lower() == key2.lower():
            raise DesiredStateError(
                f"{path}.key2", "key equal to key2: AES-XTS needs two distinct keys"
            )
        nbytes = len(key) // 2
        sizes = (
            MLX5_KEY_HALF_BYTES_ALLOWED
            if desired.accel.module == "mlx5"
            else XTS_KEY_HALF_BYTES_ALLOWED
        )
        if nbytes not in sizes:
            who = "the mlx5 accel module" if desired.accel.module == "mlx5" else "AES_XTS"
            allowed = " or ".join(map(str, sizes)) + " bytes"
            raise DesiredStateError(f"{path}.key", f"{nbytes}-byte key: {who} takes {allowed}")
