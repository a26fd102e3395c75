"""The desired network state: the `[net]` section of the agent's config, validated.

[net]
netns = ""                          # "" = this namespace (tests use their own)
[[net.interfaces]]
name = "p0"                         # an existing link: uplink, PF or SF representor
mtu = 9000
vlan = 100                          # 0 = none; else p0.100 carries addresses and routes
addresses = ["192.0.2.10/24"]
routes = [{ dst = "198.51.100.0/24", gateway = "192.0.2.1" }]
qdisc = "fq"                        # root qdisc kind for kernel traffic (NVMe/TCP); "" = keep
pfc_priorities = [3]                # lossless priorities (dcb pfc); [] = leave PFC alone
trust = "dscp"                      # "dscp" or "" (pcp/default: leave it)
dscp_prio = { "26" = 3, "48" = 6 }  # DSCP -> priority (dcb app dscp-prio)
[net.interfaces.ets]                # optional (dcb ets)
prio_tc = [0, 1, 2, 3, 4, 5, 6, 7]
tc_tsa = ["ets", "ets", "ets", "ets", "ets", "ets", "strict", "strict"]
tc_bw = [10, 10, 10, 50, 10, 10, 0, 0]
[net.interfaces.ecn]                # optional: DCQCN knobs of the DOCA/MLNX driver (sysfs)
np_priorities = [3]
rp_priorities = [3]
cnp_dscp = 48
cnp_802p_prio = 6
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvproto.tomlfile import CONFIG_BYTES_MAX, TomlFileError, load_toml

__all__ = [
    "INTERFACES_MAX",
    "SYSFS_NET",
    "EcnSpec",
    "EtsSpec",
    "InterfaceSpec",
    "NetConfigError",
    "NetDesired",
    "RouteSpec",
    "check_netns",
    "load_net",
    "parse_net",
    "valid_ifname",
]

SYSFS_NET = Path("/sys/class/net")  # where the driver's qos/ and ecn/ knobs live
INTERFACES_MAX = 16  # a BlueField has 2 uplinks, their PFs/SFs/VLANs: 16 is plenty
ADDRESSES_MAX = 32  # per interface
ROUTES_MAX = 256  # per interface; a static fabric's prefixes, not a routing table
MTU_MIN, MTU_MAX = 68, 9216  # IPv4 minimum; DPF uses 9216, the largest BlueField MTU
PRIOS = 8  # 802.1p priorities / traffic classes
TSA = ("strict", "cbs", "ets", "vendor")  # dcb ets tc-tsa keywords
IFNAME_BYTES_MAX = 15  # IFNAMSIZ - 1: the kernel's limit (dev_valid_name)
NETNS_BYTES_MAX = 64  # ip netns names a file in /var/run/netns; 64 is ample for any scheme
# Names go into netlink messages, dcb and tc argv and /var/run/netns paths: a strict set (what
# the kernel's dev_valid_name allows, less anything a shell, a path or `ip` output reads
# specially); "." and ".." are directory entries, not names.
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


class NetConfigError(ValueError):
    """[net] is invalid; the message names the key, the value and what is allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteSpec:
    dst: str  # normalised network, e.g. "198.51.100.0/24"
    gateway: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class EtsSpec:
    prio_tc: tuple[int, ...]
    tc_tsa: tuple[str, ...]
    tc_bw: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class EcnSpec:
    np_priorities: tuple[int, ...] = ()
    rp_priorities: tuple[int, ...] = ()
    cnp_dscp: int | None = None
    cnp_802p_prio: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class InterfaceSpec:
    name: str
    mtu: int = 0  # 0 = leave it
    vlan: int = 0
    addresses: tuple[str, ...] = ()  # normalised "ip/prefix"
    routes: tuple[RouteSpec, ...] = ()
    qdisc: str = ""
    pfc_priorities: tuple[int, ...] | None = None  # None = leave PFC alone
    trust: str = ""
    dscp_prio: dict[int, int] = field(default_factory=dict)
    ets: EtsSpec | None = None
    ecn: EcnSpec | None = None

    @property
    def l3_name(self) -> str:
        """The link that carries addresses and routes: the VLAN link when there is one."""
        return f"{self.name}.{self.vlan}" if self.vlan else self.name

    @property
    def wants_dcb(self) -> bool:
        return self.pfc_priorities is not None or bool(self.dscp_prio) or self.ets is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class NetDesired:
    interfaces: tuple[InterfaceSpec, ...] = ()
    netns: str = ""


def load_net(path: str | Path) -> NetDesired:
    """The [net] section of an agent config file."""
    p = Path(path)
    try:
        doc = load_toml(p, max_bytes=CONFIG_BYTES_MAX)
    except TomlFileError as e:
        raise NetConfigError(str(e)) from None
    if "net" not in doc:
        raise NetConfigError(f"{p} has no [net] section (see docs/NETWORK.md)")
    return parse_net(doc["net"], str(p))


def _keys(table: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise NetConfigError(f"{where} must be a table")
    unknown = set(table) - allowed
    if unknown:
        raise NetConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(allowed)}")
    return table


def _int(value: Any, lo: int, hi: int, where: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise NetConfigError(f"{where} = {value!r}: an integer {lo}..{hi}")
    return value


def _prios(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise NetConfigError(f"{where} = {value!r}: a list of priorities 0..7")
    out = tuple(sorted({_int(v, 0, PRIOS - 1, where) for v in value}))
    return out


def valid_ifname(name: object) -> bool:
    """What the kernel's dev_valid_name accepts (1..15 bytes, not "." or "..", no "/", ":" or
    whitespace), restricted to letters, digits, "_", "." and "-"."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode()) <= IFNAME_BYTES_MAX
        and name not in (".", "..")
        and _NAME_RE.fullmatch(name) is not None
    )


def check_netns(name: object, where: str) -> str:
    """A network namespace name ("" = this one); NetConfigError unless it is a plain file name
    under /var/run/netns."""
    if name == "":
        return ""
    ok = (
        isinstance(name, str)
        and len(name.encode()) <= NETNS_BYTES_MAX
        and name not in (".", "..")
        and _NAME_RE.fullmatch(name) is not None
    )
    if not ok:
        raise NetConfigError(
            f"{where} = {name!r}: a network namespace name of 1..{NETNS_BYTES_MAX} letters, "
            "digits, '_', '.', '-' (not '.' or '..'), as `ip netns list` shows it"
        )
    assert isinstance(name, str)
    return name


def parse_net(section: Any, source: str = "[net]") -> NetDesired:
    net = _keys(section, {"netns", "interfaces"}, f"{source}: [net]")
    items = net.get("interfaces", [])
    if not isinstance(items, list) or len(items) > INTERFACES_MAX:
        raise NetConfigError(f"{source}: [[net.interfaces]] is a list of at most {INTERFACES_MAX}")
    specs = tuple(_interface(t, f"{source}: net.interfaces[{i}]") for i, t in enumerate(items))
    names = [s.name for s in specs] + [s.l3_name for s in specs if s.vlan]
    if len(set(names)) != len(names):
        raise NetConfigError(f"{source}: an interface is listed twice ({names})")
    netns = check_netns(net.get("netns", ""), f"{source}: [net] netns")
    return NetDesired(interfaces=specs, netns=netns)


def _interface(table: Any, where: str) -> InterfaceSpec:
    allowed = {"name", "mtu", "vlan", "addresses", "routes", "qdisc", "pfc_priorities",
               "trust", "dscp_prio", "ets", "ecn"}  # fmt: skip
    t = _keys(table, allowed, where)
    name = t.get("name")
    if not valid_ifname(name):
        raise NetConfigError(
            f"{where}: name = {name!r}: an interface name of 1..{IFNAME_BYTES_MAX} characters: "
            "letters, digits, '_', '.', '-' (not '.' or '..'; no '/', ':' or whitespace)"
        )
    assert isinstance(name, str)
    where = f"{where} ({name})"
    vlan = _int(t.get("vlan", 0), 0, 4094, f"{where} vlan")
    if vlan and len(f"{name}.{vlan}") > 15:
        raise NetConfigError(f"{where}: {name}.{vlan} is longer than 15 characters")
    mtu = t.get("mtu", 0)
    if mtu != 0:
        mtu = _int(mtu, MTU_MIN, MTU_MAX, f"{where} mtu")
    trust = t.get("trust", "")
    if trust not in ("", "dscp"):
        raise NetConfigError(f"{where}: trust = {trust!r}: 'dscp' or '' (leave it)")
    dscp_prio = _dscp_map(t.get("dscp_prio", {}), f"{where} dscp_prio")
    if trust == "dscp" and not dscp_prio:
        raise NetConfigError(f"{where}: trust = 'dscp' needs a dscp_prio map (mlx5 trusts DSCP "
                             "once it has a DSCP app entry)")  # fmt: skip
    qdisc = t.get("qdisc", "")
    if not isinstance(qdisc, str) or (qdisc and not re.fullmatch(r"[a-z_]{2,16}", qdisc)):
        raise NetConfigError(f"{where}: qdisc = {qdisc!r}: a qdisc kind like 'fq' or ''")
    pfc = t.get("pfc_priorities")
    return InterfaceSpec(
        name=name,
        mtu=mtu,
        vlan=vlan,
        addresses=_addresses(t.get("addresses", []), f"{where} addresses"),
        routes=_routes(t.get("routes", []), f"{where} routes"),
        qdisc=qdisc,
        pfc_priorities=None if pfc is None else _prios(pfc, f"{where} pfc_priorities"),
        trust=trust,
        dscp_prio=dscp_prio,
        ets=_ets(t["ets"], f"{where} ets") if "ets" in t else None,
        ecn=_ecn(t["ecn"], f"{where} ecn") if "ecn" in t else None,
    )


def _addresses(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > ADDRESSES_MAX:
        raise NetConfigError(f"{where}: a list of at most {ADDRESSES_MAX} 'ip/prefix' strings")
    out = []
    for a in value:
        try:
            iface = ipaddress.ip_interface(a)
        except ValueError:
            raise NetConfigError(f"{where}: {a!r} is not an address like 192.0.2.10/24") from None
        if "/" not in str(a):
            raise NetConfigError(f"{where}: {a!r} needs a prefix length (192.0.2.10/24)")
        out.append(iface.with_prefixlen)
    return tuple(dict.fromkeys(out))


def _routes(value: Any, where: str) -> tuple[RouteSpec, ...]:
    if not isinstance(value, list) or len(value) > ROUTES_MAX:
        raise NetConfigError(f"{where}: a list of at most {ROUTES_MAX} {{dst, gateway}} tables")
    out = []
    for i, r in enumerate(value):
        r = _keys(r, {"dst", "gateway"}, f"{where}[{i}]")
        try:
            dst = ipaddress.ip_network(r.get("dst", ""), strict=False)
            gw = ipaddress.ip_address(r["gateway"]) if r.get("gateway") else None
        except ValueError as e:
            raise NetConfigError(f"{where}[{i}]: {e}") from None
        if gw is not None and gw.version != dst.version:
            raise NetConfigError(f"{where}[{i}]: gateway {gw} is not IPv{dst.version}")
        out.append(RouteSpec(dst=dst.with_prefixlen, gateway=str(gw) if gw else ""))
    return tuple(out)


def _dscp_map(value: Any, where: str) -> dict[int, int]:
    if not isinstance(value, dict):
        raise NetConfigError(f'{where}: a table like {{ "26" = 3 }} (DSCP = priority)')
    out = {}
    for k, v in value.items():
        if not str(k).isdigit():
            raise NetConfigError(f"{where}: DSCP {k!r} is not a number 0..63")
        out[_int(int(k), 0, 63, f"{where} DSCP")] = _int(v, 0, PRIOS - 1, f"{where}[{k}]")
    return dict(sorted(out.items()))


def _ets(value: Any, where: str) -> EtsSpec:
    t = _keys(value, {"prio_tc", "tc_tsa", "tc_bw"}, where)
    for k in ("prio_tc", "tc_tsa", "tc_bw"):
        if not isinstance(t.get(k), list) or len(t[k]) != PRIOS:
            raise NetConfigError(f"{where}: {k} must list {PRIOS} values")
    prio_tc = tuple(_int(v, 0, PRIOS - 1, f"{where} prio_tc") for v in t["prio_tc"])
    tsa = tuple(t["tc_tsa"])
    if any(v not in TSA for v in tsa):
        raise NetConfigError(f"{where}: tc_tsa values are {', '.join(TSA)}, not {list(tsa)}")
    bw = tuple(_int(v, 0, 100, f"{where} tc_bw") for v in t["tc_bw"])
    ets_bw = sum(b for b, s in zip(bw, tsa, strict=True) if s == "ets")
    if "ets" in tsa and ets_bw != 100:
        raise NetConfigError(
            f"{where}: tc_bw of the 'ets' classes must add up to 100, not {ets_bw}"
        )
    return EtsSpec(prio_tc=prio_tc, tc_tsa=tsa, tc_bw=bw)


def _ecn(value: Any, where: str) -> EcnSpec:
    t = _keys(value, {"np_priorities", "rp_priorities", "cnp_dscp", "cnp_802p_prio"}, where)
    return EcnSpec(
        np_priorities=_prios(t.get("np_priorities", []), f"{where} np_priorities"),
        rp_priorities=_prios(t.get("rp_priorities", []), f"{where} rp_priorities"),
        cnp_dscp=_int(t["cnp_dscp"], 0, 63, f"{where} cnp_dscp") if "cnp_dscp" in t else None,
        cnp_802p_prio=(
            _int(t["cnp_802p_prio"], 0, 7, f"{where} cnp_802p_prio")
            if "cnp_802p_prio" in t
            else None
        ),
    )
