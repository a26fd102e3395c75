"""Firmware profiles for BlueField DPUs: plan and apply mlxconfig parameters (dpuctl firmware).

Desired state: a TOML profile (firmware_profiles/), checked against the parameter schema from
mstflint's database. Live state: `mlxconfig -j query` (or mstconfig's table). Plan per
parameter, one `-y set` call, query again, and say what activates the new values.
"""

from dpu_agent.firmware._profile import (
    ACTIVATIONS,
    PROFILE_DIRS,
    Param,
    Profile,
    ProfileError,
    load_profile,
    load_schema,
    profile_names,
    schema_param,
)
from dpu_agent.firmware._query import (
    DeviceConfig,
    FirmwareToolError,
    FirmwareUnavailable,
    LiveParam,
    Tool,
    find_tool,
    parse_json_query,
    parse_text_query,
    parse_value,
    query_device,
    run_set,
    set_argv,
)
from dpu_agent.firmware._reconcile import (
    ApplyResult,
    Change,
    FirmwareApplyError,
    FirmwareConflict,
    FirmwarePlan,
    apply,
    plan,
)

__all__ = [
    "ACTIVATIONS",
    "PROFILE_DIRS",
    "ApplyResult",
    "Change",
    "DeviceConfig",
    "FirmwareApplyError",
    "FirmwareConflict",
    "FirmwarePlan",
    "FirmwareToolError",
    "FirmwareUnavailable",
    "LiveParam",
    "Param",
    "Profile",
    "ProfileError",
    "Tool",
    "apply",
    "find_tool",
    "load_profile",
    "load_schema",
    "parse_json_query",
    "parse_text_query",
    "parse_value",
    "plan",
    "profile_names",
    "query_device",
    "run_set",
    "schema_param",
    "set_argv",
]
