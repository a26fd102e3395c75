"""The live network state, read through the kernel's own interfaces: rtnetlink (pyroute2) for
links, addresses, routes and the root qdisc; `dcb -j` for PFC, the DSCP map and ETS; sysfs for
the driver's trust and ECN/DCQCN knobs (DOCA/MLNX_OFED mlx5 only; absent elsewhere)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute

from dpu_agent.net._dcb import DcbState, read_dcb
from dpu_agent.net._desired import PRIOS, SYSFS_NET, NetDesired, check_netns

__all__ = ["SYSFS_NET", "LinkState", "NetLive", "ecn_knobs", "open_ipr", "qdisc_unavailable",
           "read_live"]  # fmt: skip

MAIN_TABLE = 254
ROOT_PARENT = 0xFFFFFFFF  # TC_H_ROOT
RTPROT_KERNEL = 2  # routes the kernel adds for an address' own subnet


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkState:
    index: int
    mtu: int
    up: bool
    kind: str  # "veth", "vlan", "" (a physical or SF netdev)
    vlan_id: int = 0
    parent: int = 0  # IFLA_LINK
    addresses: frozenset[str] = frozenset()
    routes: frozenset[tuple[str, str]] = frozenset()  # (dst, gateway) via this link, static
    qdisc: str = ""  # root qdisc kind; "" = none (noqueue)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetLive:
    links: dict[str, LinkState]
    dcb: dict[str, DcbState] = field(default_factory=dict)
    sysfs: dict[str, dict[str, str]] = field(default_factory=dict)  # ifname -> knob -> value
    # qdisc kind -> why this kernel cannot give it (only the kinds [net] asks for)
    qdiscs_missing: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def open_ipr(netns: str = "") -> Iterator[IPRoute]:
    netns = check_netns(netns, "netns")  # pyroute2 opens /var/run/netns/<name>
    ipr = IPRoute(netns=netns) if netns else IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def _links(ipr: IPRoute) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for msg in ipr.get_links():
        info = msg.get("IFLA_LINKINFO")
        kind = (info.get("IFLA_INFO_KIND") if info else None) or ""
        data = info.get("IFLA_INFO_DATA") if info else None
        vlan_id = (data.get("IFLA_VLAN_ID") if kind == "vlan" and data else None) or 0
        out[msg.get("IFLA_IFNAME")] = {
            "index": msg["index"],
            "mtu": msg.get("IFLA_MTU"),
            "up": bool(msg["flags"] & 1),  # IFF_UP: administratively up
            "kind": kind,
            "vlan_id": vlan_id,
            "parent": msg.get("IFLA_LINK") or 0,
        }
    return out


def read_links(ipr: IPRoute) -> dict[str, LinkState]:
    raw = _links(ipr)
    by_index = {v["index"]: k for k, v in raw.items()}
    addrs: dict[str, set[str]] = {k: set() for k in raw}
    for a in ipr.get_addr():
        name = by_index.get(a["index"])
        if name is not None and a.get("IFA_ADDRESS"):
            iface = ipaddress.ip_interface(f"{a.get('IFA_ADDRESS')}/{a['prefixlen']}")
            if not iface.is_link_local:
                addrs[name].add(iface.with_prefixlen)
    routes: dict[str, set[tuple[str, str]]] = {k: set() for k in raw}
    for family in (2, 10):
        for r in ipr.get_routes(family=family, table=MAIN_TABLE):
            name = by_index.get(r.get("RTA_OIF"))
            if name is None or r["proto"] == RTPROT_KERNEL or r["type"] != 1:  # unicast
                continue
            dst = r.get("RTA_DST") or ("0.0.0.0" if family == 2 else "::")
            net = ipaddress.ip_network(f"{dst}/{r['dst_len']}", strict=False)
            routes[name].add((net.with_prefixlen, r.get("RTA_GATEWAY") or ""))
    qdiscs = {
        q["index"]: q.get("TCA_KIND") or "" for q in ipr.get_qdiscs() if q["parent"] == ROOT_PARENT
    }
    return {
        name: LinkState(
            addresses=frozenset(addrs[name]),
            routes=frozenset(routes[name]),
            qdisc=qdiscs.get(v["index"], ""),
            **v,
        )
        for name, v in raw.items()
    }


def ecn_knobs(ifname: str, sysfs_root: Path = SYSFS_NET) -> dict[str, Path]:
    """The driver's trust and ECN/DCQCN files for `ifname` that exist (name -> path)."""
    base = sysfs_root / ifname
    candidates = {"qos/trust": base / "qos" / "trust"}
    for side in ("roce_np", "roce_rp"):
        for prio in range(PRIOS):
            candidates[f"ecn/{side}/enable/{prio}"] = base / "ecn" / side / "enable" / str(prio)
    for knob in ("cnp_dscp", "cnp_802p_prio"):
        candidates[f"ecn/roce_np/{knob}"] = base / "ecn" / "roce_np" / knob
    return {k: p for k, p in candidates.items() if p.is_file()}


def _read_sysfs(ifname: str, sysfs_root: Path) -> dict[str, str]:
    out = {}
    for knob, path in ecn_knobs(ifname, sysfs_root).items():
        with contextlib.suppress(OSError):
            out[knob] = path.read_text().strip()
    return out


# In every kernel with networking (sch_generic, sch_mq, sch_api are not modules)
ALWAYS_THERE_QDISCS = frozenset({"pfifo_fast", "mq", "noqueue", "blackhole"})
PROBE_TIMEOUT_S = 10.0


def qdisc_unavailable(
    kind: str,
    *,
    sys_module: Path = Path("/sys/module"),
    proc_modules: Path = Path("/proc/modules"),
    modules_dir: Path | None = None,
) -> str:
    """Why this kernel cannot give root qdisc `kind`, or "" when it can or nothing can tell.

    Loaded or built in with parameters: /sys/module/sch_KIND; loaded: /proc/modules; built in
    or loadable (tc loads it on demand): modules.builtin and modules.dep. A kernel without
    module files (a monolithic or VM kernel) is asked directly, as root, in a scratch network
    namespace that disappears with the probe."""
    if kind in ALWAYS_THERE_QDISCS:
        return ""
    mod = f"sch_{kind}"
    if (sys_module / mod).exists():
        return ""
    with contextlib.suppress(OSError):
        if any(line.split(" ", 1)[0] == mod for line in proc_modules.read_text().splitlines()):
            return ""
    where = modules_dir or Path("/lib/modules") / platform.release()
    try:
        listed = (where / "modules.builtin").read_text() + (where / "modules.dep").read_text()
    except OSError:
        return _try_in_scratch_netns(kind)
    if f"/{mod}.ko" in listed:
        return ""
    return f"this kernel has no {mod} (not loaded, not built in, no module in {where})"


def _try_in_scratch_netns(kind: str) -> str:
    tools = shutil.which("unshare") and shutil.which("tc")
    if os.geteuid() != 0 or not tools:
        return ""  # cannot tell: apply will say
    argv = ["unshare", "--net", "tc", "qdisc", "replace", "dev", "lo", "root", kind]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if out.returncode == 0:
        return ""
    first = (out.stderr.strip().splitlines() or ["refused"])[0]
    return (
        f"this kernel has no sch_{kind} (tc qdisc replace ... root {kind} in a scratch "
        f"namespace: {first})"
    )


def read_live(desired: NetDesired, ipr: IPRoute, sysfs_root: Path = SYSFS_NET) -> NetLive:
    links = read_links(ipr)
    dcb = {
        s.name: read_dcb(s.name, desired.netns)
        for s in desired.interfaces
        if s.wants_dcb and s.name in links
    }
    # /sys/class/net shows this process' namespace: another namespace's knobs are not there
    # (a same-named host interface would be), so they need an explicit --sysfs-root
    foreign = bool(desired.netns) and sysfs_root == SYSFS_NET
    sysfs = {s.name: {} if foreign else _read_sysfs(s.name, sysfs_root) for s in desired.interfaces}
    wanted = {s.qdisc for s in desired.interfaces
              if s.qdisc and s.name in links and links[s.name].qdisc != s.qdisc}  # fmt: skip
    missing = {k: why for k in sorted(wanted) if (why := qdisc_unavailable(k))}
    return NetLive(links=links, dcb=dcb, sysfs=sysfs, qdiscs_missing=missing)
