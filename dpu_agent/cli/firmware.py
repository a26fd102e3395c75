"""`dpuctl firmware plan|apply|status|profiles`: BlueField firmware parameters from a profile.

Exit codes: 0 done / in sync; 1 conflicts, the tool refused the set, or status found values
that differ; 2 usage; 3 no mlxconfig/mstconfig, or the device cannot be opened; 4 the profile
or the query file is invalid; 5 the values are written but wait for a reboot or a host power
cycle (the JSON's `activation` says which).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dpu_agent import firmware as fw
from dpu_agent.cli._common import exits_on, plan_conflicts, show

__all__ = ["firmware_group"]

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_PROFILE, EXIT_ACTIVATE = 0, 1, 3, 4, 5
QUERY_FILE_BYTES_MAX = 4 << 20
F = TypeVar("F", bound=Callable[..., Any])


_errors = exits_on(
    (fw.ProfileError, EXIT_PROFILE, None),
    (fw.FirmwareUnavailable, EXIT_UNAVAILABLE, None),
    (fw.FirmwareConflict, EXIT_FAILED, plan_conflicts),
    (fw.FirmwareApplyError, EXIT_FAILED, lambda e: (str(e), {"returncode": e.cause.returncode})),
    (fw.FirmwareToolError, EXIT_FAILED, lambda e: (str(e), {"returncode": e.returncode})),
)


def _options(fn: F) -> F:
    fn = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)
    fn = click.option("--tool", default=None, help="mlxconfig or mstconfig (default: found).")(fn)
    fn = click.option(
        "--query-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="Plan from a saved `mlxconfig -e -j FILE query` (or its table) instead of a device.",
    )(fn)
    fn = click.option("--profile", required=True, help="Profile name or .toml path.")(fn)
    return click.option("--device", default=None, help="mst device or PCI address.")(fn)


def _live(device: str | None, query_file: str | None, tool: str | None) -> fw.DeviceConfig:
    if query_file is not None:
        try:
            text = Path(query_file).read_bytes()[:QUERY_FILE_BYTES_MAX].decode()
            if text.lstrip().startswith("{"):
                return fw.parse_json_query(json.loads(text))
            return fw.parse_text_query(text)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise fw.ProfileError(f"query file {query_file}: {e}") from None
    if device is None:
        raise click.UsageError("give --device DEV (or --query-file FILE)")
    return fw.query_device(device, fw.find_tool(tool))


def _render_plan(p: dict[str, Any]) -> str:
    lines = [f"{p['device']} ({p['device_type']}), profile {p['profile']}"]
    for c in p["changes"]:
        if c["action"] != "ok":
            lines.append(f"  {c['action']:8} {c['name']}: {c['why']}")
    lines += [f"CONFLICT {c}" for c in p["conflicts"]]
    if p["in_sync"]:
        lines.append("in sync: every parameter is live")
    elif p["activation"]:
        lines.append(f"after apply: {p['activation'].replace('_', ' ')} to activate")
    return "\n".join(lines)


@click.group("firmware", help="BlueField firmware parameters (mlxconfig) from a profile.")
def firmware_group() -> None:
    pass


@firmware_group.command("plan", help="Per parameter: current, next boot, desired, action.")
@_options
@_errors
def plan_cmd(
    device: str | None, profile: str, query_file: str | None, tool: str | None, as_json: bool
) -> None:
    result = fw.plan(fw.load_profile(profile), _live(device, query_file, tool), fw.load_schema())
    show(result.to_json(), as_json, _render_plan)
    sys.exit(EXIT_FAILED if result.conflicts else EXIT_OK)


@firmware_group.command("status", help="Exit 0 in sync, 5 waiting for activation, 1 differs.")
@_options
@_errors
def status_cmd(
    device: str | None, profile: str, query_file: str | None, tool: str | None, as_json: bool
) -> None:
    result = fw.plan(fw.load_profile(profile), _live(device, query_file, tool), fw.load_schema())
    show(result.to_json(), as_json, _render_plan)
    pending_only = not result.conflicts and not result.to_set
    sys.exit(EXIT_OK if result.in_sync else EXIT_ACTIVATE if pending_only else EXIT_FAILED)


@firmware_group.command("apply", help="One `-y set` of every change; exit 5: reboot needed.")
@click.option("--device", required=True, help="mst device or PCI address.")
@click.option("--profile", required=True, help="Profile name or .toml path.")
@click.option("--tool", default=None, help="mlxconfig or mstconfig (default: found).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_errors
def apply_cmd(device: str, profile: str, tool: str | None, as_json: bool) -> None:
    result = fw.apply(fw.load_profile(profile), device, fw.find_tool(tool), fw.load_schema())
    doc = result.to_json()
    show(
        doc, as_json, lambda d: f"set {len(d['applied'])} parameter(s)\n" + _render_plan(d["after"])
    )
    if not result.converged:
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_ACTIVATE if result.after.activation else EXIT_OK)


@firmware_group.command("profiles", help="The known profiles, or one in full (--profile).")
@click.option("--profile", default=None, help="Show this profile's parameters.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_errors
def profiles_cmd(profile: str | None, as_json: bool) -> None:
    if profile is None:
        names = fw.profile_names()
        click.echo(json.dumps(names) if as_json else "\n".join(names))
        return
    doc = fw.load_profile(profile).to_json(fw.load_schema())
    show(doc, as_json, lambda d: "\n".join(f"{k} = {v}" for k, v in d["parameters"].items()))
