"""`dpuctl net plan|apply|status`: the RoCE network from the `[net]` section of the config.

Exit codes: 0 done / in sync; 1 conflicts (e.g. a driver without DCB), a step failed (the
JSON says which and what was applied before it), or status found drift; 2 usage; 3 the
network namespace does not exist; 4 the config is invalid (the message names the key).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dpu_agent import net
from dpu_agent.cli._common import exits_on, plan_conflicts, show

__all__ = ["net_group"]

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_CONFIG = 0, 1, 3, 4
F = TypeVar("F", bound=Callable[..., Any])


_errors = exits_on(
    (net.NetConfigError, EXIT_CONFIG, None),
    (net.NetnsMissing, EXIT_UNREACHABLE, None),
    (net.NetConflict, EXIT_FAILED, plan_conflicts),
    (net.NetApplyError, EXIT_FAILED, lambda e: (str(e), {"step": e.step, "done": e.done})),
)


def _options(fn: F) -> F:
    fn = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)
    fn = click.option(
        "--sysfs-root",
        type=click.Path(file_okay=False, path_type=Path),
        default=net.SYSFS_NET,
        show_default=True,
        help="Where the driver's qos/ and ecn/ knobs are.",
    )(fn)
    fn = click.option("--netns", default=None, help="Network namespace (default: [net] netns).")(fn)
    return click.option(
        "--config", required=True, envvar="DPUKV_CONFIG", type=click.Path(dir_okay=False)
    )(fn)


def _render_plan(p: dict[str, Any]) -> str:
    lines = [
        f"{i:3}. {s['kind']} {s['target']} {json.dumps(s['params'])}  # {s['why']}"
        for i, s in enumerate(p["steps"], 1)
    ]
    if p["in_sync"]:
        lines.append("in sync: nothing to do")
    elif not lines:
        lines.append("not in sync: nothing can be done until the lines below are resolved")
    lines += [f"CONFLICT {c}" for c in p["conflicts"]]
    lines += [f"unmanaged {u}" for u in p["unmanaged"]]
    return "\n".join(lines + [f"note {n}" for n in p["notes"]])


@click.group("net", help="The DPU's RoCE network ([net]): addresses, MTU, VLAN, routes, PFC, ECN.")
def net_group() -> None:
    pass


@net_group.command("plan", help="The steps that would reconcile the network (exit 1: conflicts).")
@_options
@_errors
def plan_cmd(config: str, netns: str | None, sysfs_root: Path, as_json: bool) -> None:
    p = net.run_plan(config, netns, sysfs_root)
    show(p, as_json, _render_plan)
    sys.exit(EXIT_FAILED if p["conflicts"] else EXIT_OK)


@net_group.command("apply", help="Run the plan; stop at the first failure; read back.")
@_options
@_errors
def apply_cmd(config: str, netns: str | None, sysfs_root: Path, as_json: bool) -> None:
    r = net.run_apply(config, netns, sysfs_root)
    show(r, as_json, lambda d: f"applied {len(d['applied'])} step(s)\n" + _render_plan(d["after"]))
    sys.exit(EXIT_OK if r["after"]["in_sync"] else EXIT_FAILED)


@net_group.command("status", help="Drift report: exit 0 in sync, 1 differs.")
@_options
@_errors
def status_cmd(config: str, netns: str | None, sysfs_root: Path, as_json: bool) -> None:
    s = net.run_status(config, netns, sysfs_root)
    show(s, as_json, _render_plan)
    sys.exit(EXIT_OK if s["in_sync"] else EXIT_FAILED)
