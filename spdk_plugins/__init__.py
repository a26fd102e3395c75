"""spdk_plugins: desired-state SPDK configuration, plan/apply, and an rpc.py plugin.

desired = load_desired("agent.toml")              # the [spdk] section, validated
with SpdkClient(desired.socket) as client:
    print(plan(desired, client, key_provider).to_json())
    apply(desired, client, key_provider)
agent_tiers(desired)                              # what the agent's initiator connects to
"""

import importlib
from typing import TYPE_CHECKING, Any

# What each name is imported from: on first use only, so that reading a config's [spdk] table
# (dpuctl status, config check) does not pay for the RPC client and its logging.
_WHERE = {
    "ApplyError": "spdk_plugins.apply",
    "ApplyResult": "spdk_plugins.apply",
    "DesiredStateError": "spdk_plugins.desired",
    "DriftReport": "spdk_plugins.apply",
    "KeyProvider": "spdk_plugins.desired",
    "LiveState": "spdk_plugins.state",
    "Plan": "spdk_plugins.plan",
    "PlanConflict": "spdk_plugins.apply",
    "SpdkClient": "spdk_plugins.rpc",
    "SpdkConnectionError": "spdk_plugins.rpc",
    "SpdkDesired": "spdk_plugins.desired",
    "SpdkError": "spdk_plugins.rpc",
    "SpdkRpcError": "spdk_plugins.rpc",
    "SpdkTimeout": "spdk_plugins.rpc",
    "Step": "spdk_plugins.plan",
    "TierTarget": "spdk_plugins.tiers",
    "agent_tiers": "spdk_plugins.tiers",
    "apply": "spdk_plugins.apply",
    "boot_config": "spdk_plugins.bootconfig",
    "check_key_material": "spdk_plugins.desired",
    "keystore_provider": "spdk_plugins.keys",
    "load_desired": "spdk_plugins.desired",
    "parse_desired": "spdk_plugins.desired",
    "plan": "spdk_plugins.plan",
    "plan_from_live": "spdk_plugins.plan",
    "read_live": "spdk_plugins.state",
    "redact_params": "spdk_plugins.rpc",
    "status": "spdk_plugins.apply",
}

if TYPE_CHECKING:
    from spdk_plugins.apply import ApplyError, ApplyResult, DriftReport, PlanConflict, apply, status
    from spdk_plugins.bootconfig import boot_config
    from spdk_plugins.desired import (
        DesiredStateError,
        KeyProvider,
        SpdkDesired,
        check_key_material,
        load_desired,
        parse_desired,
    )
    from spdk_plugins.keys import keystore_provider
    from spdk_plugins.plan import Plan, Step, plan, plan_from_live
    from spdk_plugins.rpc import (
        SpdkClient,
        SpdkConnectionError,
        SpdkError,
        SpdkRpcError,
        SpdkTimeout,
        redact_params,
    )
    from spdk_plugins.state import LiveState, read_live
    from spdk_plugins.tiers import TierTarget, agent_tiers


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'spdk_plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


__all__ = [
    "ApplyError",
    "ApplyResult",
    "DesiredStateError",
    "DriftReport",
    "KeyProvider",
    "LiveState",
    "Plan",
    "PlanConflict",
    "SpdkClient",
    "SpdkConnectionError",
    "SpdkDesired",
    "SpdkError",
    "SpdkRpcError",
    "SpdkTimeout",
    "Step",
    "TierTarget",
    "agent_tiers",
    "apply",
    "boot_config",
    "check_key_material",
    "keystore_provider",
    "load_desired",
    "parse_desired",
    "plan",
    "plan_from_live",
    "read_live",
    "redact_params",
    "status",
]
