"""Network reconcile: [net] (desired) -> rtnetlink + `dcb -j` + sysfs (live) -> plan ->
apply (stop at the first failure, say what was applied) -> read back and plan again.

Steps are ordered by phase across interfaces (links before VLANs before addresses before
routes, QoS last), each idempotent and saying why. Addresses and routes the config does not
name are reported as unmanaged, never removed (a DPU's management address may be among them).
A `dcb` the driver refuses (veth, virtio: "Operation not supported") is a conflict: apply
changes nothing rather than half a lossless configuration.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from dpu_agent.log import get_logger
from dpu_agent.net._dcb import DcbError, app_argv, ets_argv, pfc_argv, run_dcb
from dpu_agent.net._desired import PRIOS, EtsSpec, InterfaceSpec, NetDesired
from dpu_agent.net._live import SYSFS_NET, LinkState, NetLive, ecn_knobs, read_live

__all__ = ["PHASES", "NetApplyError", "NetApplyResult", "NetConflict", "NetPlan", "NetStep",
           "apply", "plan"]  # fmt: skip

_log = get_logger("dpu_agent.net")
PHASES = ("link", "vlan", "vlan_link", "addr", "route", "qdisc", "dcb", "sysfs")


@dataclass(frozen=True, slots=True, kw_only=True)
class NetStep:
    phase: str
    kind: str
    target: str  # the interface
    params: dict[str, Any]
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "params": self.params, "why": self.why}


@dataclass(frozen=True, slots=True, kw_only=True)
class NetPlan:
    steps: tuple[NetStep, ...] = ()
    conflicts: tuple[str, ...] = ()
    unmanaged: tuple[str, ...] = ()  # live state outside [net], kept
    notes: tuple[str, ...] = ()  # desired knobs this driver does not have (skipped)

    @property
    def in_sync(self) -> bool:
        """Nothing to do, nothing in the way, and nothing [net] asks for skipped."""
        return not self.steps and not self.conflicts and not self.notes

    def to_json(self) -> dict[str, Any]:
        return {
            "in_sync": self.in_sync,
            "steps": [s.to_json() for s in self.steps],
            "conflicts": list(self.conflicts),
            "unmanaged": list(self.unmanaged),
            "notes": list(self.notes),
        }


class NetConflict(Exception):
    def __init__(self, conflicts: tuple[str, ...]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


class NetApplyError(Exception):
    """Step `index` failed; `done` steps before it were applied."""

    def __init__(self, index: int, step: NetStep, done: list[dict[str, Any]], message: str) -> None:
        self.index, self.step, self.done, self.message = index, step.to_json(), done, message
        super().__init__(
            f"step {index + 1} {step.kind} {step.target} failed: {message}; "
            f"{len(done)} step(s) before it were applied"
        )


class _Planner:
    def __init__(self, desired: NetDesired, live: NetLive) -> None:
        self.desired, self.live = desired, live
        self.steps: list[NetStep] = []
        self.conflicts: list[str] = []
        self.unmanaged: list[str] = []
        self.notes: list[str] = []

    def step(self, phase: str, kind: str, target: str, why: str, **params: Any) -> None:
        self.steps.append(NetStep(phase=phase, kind=kind, target=target, params=params, why=why))

    def link(self, name: str, mtu: int, phase: str, link: LinkState | None) -> None:
        if mtu and (link is None or link.mtu != mtu):
            was = link.mtu if link is not None else "new"
            self.step(phase, "link_set_mtu", name, f"MTU {was} -> {mtu}", mtu=mtu)
        if link is None or not link.up:
            self.step(phase, "link_up", name, "administratively down")

    def interface(self, s: InterfaceSpec) -> None:
        parent = self.live.links.get(s.name)
        if parent is None:
            self.conflicts.append(f"{s.name}: no such link (an uplink, PF or SF netdev?)")
            return
        self.link(s.name, s.mtu, "link", parent)
        l3 = self.live.links.get(s.l3_name)
        if s.vlan:
            if l3 is None:
                self.step("vlan", "vlan_add", s.l3_name, f"VLAN {s.vlan} on {s.name}",
                          parent=s.name, vlan_id=s.vlan)  # fmt: skip
            elif l3.kind != "vlan" or l3.vlan_id != s.vlan or l3.parent != parent.index:
                self.conflicts.append(f"{s.l3_name} exists but is not VLAN {s.vlan} on {s.name}")
                return
            self.link(s.l3_name, s.mtu, "vlan_link", l3)
        self.l3(s, l3 if s.vlan else parent)
        if s.qdisc and parent.qdisc != s.qdisc:
            if s.qdisc in self.live.qdiscs_missing:
                self.conflicts.append(f"{s.name}: qdisc = {s.qdisc!r}: "
                                      f"{self.live.qdiscs_missing[s.qdisc]}")  # fmt: skip
            else:
                why = f"root qdisc {parent.qdisc or 'none'} -> {s.qdisc}"
                self.step("qdisc", "qdisc_replace", s.name, why, qdisc=s.qdisc)
        if s.wants_dcb:
            self.dcb(s)
        self.sysfs(s)

    def l3(self, s: InterfaceSpec, link: LinkState | None) -> None:
        have = link.addresses if link is not None else frozenset()
        for a in s.addresses:
            if a not in have:
                self.step("addr", "addr_add", s.l3_name, f"address {a} missing", address=a)
        self.unmanaged += [f"{s.l3_name} address {a}" for a in sorted(have - set(s.addresses))]
        routes = dict(link.routes) if link is not None else {}
        for r in s.routes:
            if r.dst not in routes:
                self.step("route", "route_add", s.l3_name, f"route {r.dst} missing",
                          dst=r.dst, gateway=r.gateway)  # fmt: skip
            elif routes[r.dst] != r.gateway:
                self.step("route", "route_replace", s.l3_name,
                          f"route {r.dst} via {routes[r.dst] or 'link'} -> {r.gateway or 'link'}",
                          dst=r.dst, gateway=r.gateway)  # fmt: skip
        wanted = {r.dst for r in s.routes}
        self.unmanaged += [f"{s.l3_name} route {d}" for d in sorted(routes) if d not in wanted]

    def dcb(self, s: InterfaceSpec) -> None:
        state = self.live.dcb.get(s.name)
        if state is None or state.error:
            why = state.error if state is not None else "not read"
            self.conflicts.append(
                f"{s.name}: dcb cannot read or set DCB ({why}); the driver has no DCB "
                "(veth, virtio); on a BlueField the mlx5 uplink has"
            )
            return
        if s.pfc_priorities is not None and state.pfc != s.pfc_priorities:
            self.step("dcb", "dcb_pfc", s.name, f"PFC on {list(state.pfc or ())} -> "
                      f"{list(s.pfc_priorities)}", prios=list(s.pfc_priorities))  # fmt: skip
        if s.ets is not None and state.ets != s.ets:
            self.step("dcb", "dcb_ets", s.name, "ETS differs", prio_tc=list(s.ets.prio_tc),
                      tc_tsa=list(s.ets.tc_tsa), tc_bw=list(s.ets.tc_bw))  # fmt: skip
        have = state.dscp_prio or {}
        stale = {d: p for d, p in have.items() if s.dscp_prio.get(d) != p}
        if s.dscp_prio and stale:
            self.step("dcb", "dcb_app_del", s.name, "DSCP entries not in [net] dscp_prio",
                      dscp_prio=stale)  # fmt: skip
        missing = {d: p for d, p in s.dscp_prio.items() if have.get(d) != p}
        if missing:
            why = "DSCP->priority entries missing (the first switches mlx5 to DSCP trust)"
            self.step("dcb", "dcb_app_add", s.name, why, dscp_prio=missing)

    def sysfs(self, s: InterfaceSpec) -> None:
        wanted: dict[str, str] = {}
        if s.trust == "dscp":
            wanted["qos/trust"] = "dscp"
        if s.ecn is not None:
            for side, prios in (("roce_np", s.ecn.np_priorities), ("roce_rp", s.ecn.rp_priorities)):
                for prio in range(PRIOS):
                    wanted[f"ecn/{side}/enable/{prio}"] = "1" if prio in prios else "0"
            if s.ecn.cnp_dscp is not None:
                wanted["ecn/roce_np/cnp_dscp"] = str(s.ecn.cnp_dscp)
            if s.ecn.cnp_802p_prio is not None:
                wanted["ecn/roce_np/cnp_802p_prio"] = str(s.ecn.cnp_802p_prio)
        have = self.live.sysfs.get(s.name, {})
        absent = [k for k in wanted if k not in have]
        if absent:
            self.notes.append(
                f"{s.name}: the driver has no sysfs knob {', '.join(absent[:3])}"
                f"{' ...' if len(absent) > 3 else ''} (DOCA/MLNX mlx5 has; upstream mlx5 keeps "
                "DCQCN in debugfs cc_params): skipped"
            )
        for knob, value in wanted.items():
            if knob in have and have[knob] != value:
                self.step("sysfs", "sysfs_write", s.name, f"{knob} {have[knob]} -> {value}",
                          knob=knob, value=value)  # fmt: skip


def plan(desired: NetDesired, live: NetLive) -> NetPlan:
    p = _Planner(desired, live)
    for s in desired.interfaces:
        p.interface(s)
    steps = sorted(p.steps, key=lambda st: PHASES.index(st.phase))  # stable: per interface
    return NetPlan(steps=tuple(steps), conflicts=tuple(p.conflicts),
                   unmanaged=tuple(p.unmanaged), notes=tuple(p.notes))  # fmt: skip


class _Executor:
    def __init__(self, ipr: IPRoute, netns: str, sysfs_root: Path) -> None:
        self.ipr, self.netns, self.sysfs_root = ipr, netns, sysfs_root

    def index(self, name: str) -> int:
        found = self.ipr.link_lookup(ifname=name)
        if not found:
            raise NetlinkError(19, f"no link {name}")  # ENODEV
        return int(found[0])

    def run(self, st: NetStep) -> None:
        p, dev = st.params, st.target
        if st.kind == "link_set_mtu":
            self.ipr.link("set", index=self.index(dev), mtu=p["mtu"])
        elif st.kind == "link_up":
            self.ipr.link("set", index=self.index(dev), state="up")
        elif st.kind == "vlan_add":
            self.ipr.link("add", ifname=dev, kind="vlan", link=self.index(p["parent"]),
                          vlan_id=p["vlan_id"])  # fmt: skip
        elif st.kind == "addr_add":
            iface = ipaddress.ip_interface(p["address"])
            self.ipr.addr("add", index=self.index(dev), address=str(iface.ip),
                          prefixlen=iface.network.prefixlen)  # fmt: skip
        elif st.kind in ("route_add", "route_replace"):
            extra = {"gateway": p["gateway"]} if p["gateway"] else {}
            self.ipr.route(st.kind.removeprefix("route_"), dst=p["dst"], oif=self.index(dev),
                           **extra)  # fmt: skip
        elif st.kind == "qdisc_replace":
            self.ipr.tc("replace", kind=p["qdisc"], index=self.index(dev))
        elif st.kind == "dcb_pfc":
            run_dcb(pfc_argv(dev, tuple(p["prios"]), self.netns))
        elif st.kind == "dcb_ets":
            ets = EtsSpec(prio_tc=tuple(p["prio_tc"]), tc_tsa=tuple(p["tc_tsa"]),
                          tc_bw=tuple(p["tc_bw"]))  # fmt: skip
            run_dcb(ets_argv(dev, ets, self.netns))
        elif st.kind in ("dcb_app_add", "dcb_app_del"):
            run_dcb(app_argv(st.kind.removeprefix("dcb_app_"), dev, p["dscp_prio"], self.netns))
        elif st.kind == "sysfs_write":
            path = ecn_knobs(dev, self.sysfs_root).get(p["knob"])
            if path is None:
                raise OSError(f"{dev} has no sysfs knob {p['knob']}")
            path.write_text(p["value"] + "\n")
        else:
            raise AssertionError(st.kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetApplyResult:
    applied: tuple[dict[str, Any], ...]
    after: NetPlan

    def to_json(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "after": self.after.to_json()}


def apply(desired: NetDesired, ipr: IPRoute, sysfs_root: Path = SYSFS_NET) -> NetApplyResult:
    """Plan, refuse on conflicts, run the steps in order, read back and plan again."""
    todo = plan(desired, read_live(desired, ipr, sysfs_root))
    if todo.conflicts:
        raise NetConflict(todo.conflicts)
    ex = _Executor(ipr, desired.netns, sysfs_root)
    done: list[dict[str, Any]] = []
    for i, st in enumerate(todo.steps):
        try:
            ex.run(st)
        except (NetlinkError, DcbError, OSError) as e:
            message = e.message if isinstance(e, DcbError) else _netlink_message(e)
            _log.warning("net_apply_failed", step=i + 1, kind=st.kind, target=st.target,
                         error=message)  # fmt: skip
            raise NetApplyError(i, st, done, message) from e
        _log.info("net_apply_step", step=i + 1, kind=st.kind, target=st.target, why=st.why)
        done.append(st.to_json())
    after = plan(desired, read_live(desired, ipr, sysfs_root))
    return NetApplyResult(applied=tuple(done), after=after)


def _netlink_message(e: Exception) -> str:
    if isinstance(e, NetlinkError):
        return f"netlink error {e.code}: {e.args[1] if len(e.args) > 1 else e}"
    return str(e)
