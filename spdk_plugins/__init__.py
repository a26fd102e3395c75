"""spdk_plugins: desired-state SPDK configuration, plan/apply, and an rpc.py plugin.

desired = load_desired("agent.toml")              # the [spdk] section, validated
with SpdkClient(desired.socket) as client:
    print(plan(desired, client, key_provider).to_json())
    apply(desired, client, key_provider)
agent_tiers(desired)                              # what the agent's initiator connects to
"""

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
