"""The RoCE network of a DPU from the agent's config (`dpuctl net plan|apply|status`).

Desired: `[net]` (addresses, MTU, VLAN, routes, root qdisc, PFC, DSCP trust and map, ETS,
ECN/DCQCN knobs). Live: rtnetlink through pyroute2, `dcb -j`, sysfs. Then plan, apply, read
back, the same shape as the SPDK driver (spdk_plugins).
"""

from typing import TYPE_CHECKING, Any

from dpu_agent.net._dcb import (
    DcbError,
    DcbState,
    app_argv,
    ets_argv,
    parse_app,
    parse_ets,
    parse_pfc,
    pfc_argv,
    read_dcb,
    run_dcb,
    show_argv,
)
from dpu_agent.net._desired import (
    SYSFS_NET,
    EcnSpec,
    EtsSpec,
    InterfaceSpec,
    NetConfigError,
    NetDesired,
    RouteSpec,
    check_netns,
    load_net,
    parse_net,
    valid_ifname,
)

if TYPE_CHECKING:  # the real imports, for type checkers
    from dpu_agent.net._live import (
        LinkState,
        NetLive,
        ecn_knobs,
        open_ipr,
        qdisc_unavailable,
        read_live,
    )
    from dpu_agent.net._ops import NetnsMissing, net_session, run_apply, run_plan, run_status
    from dpu_agent.net._reconcile import (
        NetApplyError,
        NetApplyResult,
        NetConflict,
        NetPlan,
        NetStep,
        apply,
        plan,
    )

# pyroute2 takes ~0.5 s to import: the parts that use it load on first use, so `dpuctl` and
# the config loader (which parses [net]) start fast.
_LAZY = {
    "LinkState": "_live", "NetLive": "_live", "ecn_knobs": "_live",
    "open_ipr": "_live", "read_live": "_live", "qdisc_unavailable": "_live",
    "NetnsMissing": "_ops", "net_session": "_ops", "run_apply": "_ops", "run_plan": "_ops",
    "run_status": "_ops",
    "NetApplyError": "_reconcile", "NetApplyResult": "_reconcile", "NetConflict": "_reconcile",
    "NetPlan": "_reconcile", "NetStep": "_reconcile", "apply": "_reconcile", "plan": "_reconcile",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dpu_agent.net' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"dpu_agent.net.{module}"), name)


__all__ = [
    "SYSFS_NET",
    "DcbError",
    "DcbState",
    "EcnSpec",
    "EtsSpec",
    "InterfaceSpec",
    "LinkState",
    "NetApplyError",
    "NetApplyResult",
    "NetConfigError",
    "NetConflict",
    "NetDesired",
    "NetLive",
    "NetPlan",
    "NetStep",
    "NetnsMissing",
    "RouteSpec",
    "app_argv",
    "apply",
    "check_netns",
    "ecn_knobs",
    "ets_argv",
    "load_net",
    "net_session",
    "open_ipr",
    "parse_app",
    "parse_ets",
    "parse_net",
    "parse_pfc",
    "pfc_argv",
    "plan",
    "qdisc_unavailable",
    "read_dcb",
    "read_live",
    "run_apply",
    "run_dcb",
    "run_plan",
    "run_status",
    "show_argv",
    "valid_ifname",
]
