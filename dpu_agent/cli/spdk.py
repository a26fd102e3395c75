"""`dpuctl spdk`: drive SPDK on the DPU from the `[spdk]` section of the agent's config.

Exit codes: 0 done (status: in sync); 1 SPDK refused a step, the plan has conflicts, or
status found drift; 2 usage; 3 SPDK unreachable (socket missing, timeout, connection lost);
4 the config is invalid (the message names the field).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from dpu_agent import spdk_ops as ops
from dpu_agent.cli._common import exits_on, plan_conflicts, show
from dpu_agent.crypto import KeyStoreError
from spdk_plugins.apply import ApplyError, PlanConflict
from spdk_plugins.desired import DesiredStateError
from spdk_plugins.rpc import SpdkConnectionError, SpdkError, SpdkTimeout
from spdk_plugins.saved import SavedConfigError

__all__ = ["spdk_group"]

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_CONFIG = 0, 1, 3, 4
F = TypeVar("F", bound=Callable[..., Any])
# the agent's TOML with [spdk]; or $DPUKV_CONFIG. A missing file is a usage error, said by click
_CONFIG = click.Path(exists=True, dir_okay=False)


def _os_error(e: OSError) -> tuple[str, dict[str, Any]]:
    """ "[Errno 2] ..." says less than the file and the reason."""
    return (f"{e.filename}: {e.strerror}" if e.filename else str(e)), {}


# Driver errors to exit codes, in one place.
_errors = exits_on(
    (OSError, EXIT_CONFIG, _os_error),
    ((DesiredStateError, SavedConfigError, KeyStoreError, ValueError), EXIT_CONFIG, None),
    (PlanConflict, EXIT_FAILED, plan_conflicts),
    (ApplyError, EXIT_FAILED, lambda e: (str(e), {"step": e.step, "code": e.code, "done": e.done})),
    ((SpdkConnectionError, SpdkTimeout), EXIT_UNREACHABLE, None),
    (SpdkError, EXIT_FAILED, None),
)


def _options(fn: F) -> F:
    fn = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)
    fn = click.option("--socket", default=None, help="SPDK RPC socket (default: [spdk].socket).")(
        fn
    )
    fn = click.option("--key-file", default=None, help="Agent key file (default: environment).")(fn)
    fn = click.option("--config", "config", required=True, envvar="DPUKV_CONFIG", type=_CONFIG)(fn)
    return fn


def _render_steps(steps: list[dict[str, Any]]) -> list[str]:
    return [
        f"{i:3}. {s['method']} {json.dumps(s['params'], separators=(',', ':'))}  # {s['why']}"
        for i, s in enumerate(steps, 1)
    ]


def _render_plan(p: dict[str, Any]) -> str:
    lines = [f"offline, against {p['offline']}"] if "offline" in p else []
    lines += [f"assumed {a}" for a in p.get("assumed", ())]
    lines += _render_steps(p["steps"]) or ([] if p["conflicts"] else ["in sync: nothing to do"])
    lines += [f"CONFLICT {c}" for c in p["conflicts"]]
    lines += [f"unmanaged {u}" for u in p["unmanaged"]]
    return "\n".join(lines)


def _render_apply(r: dict[str, Any]) -> str:
    lines = [f"applied {len(r['applied'])} step(s)", *_render_steps(r["applied"])]
    left, conflicts = r["after"]["steps"], r["after"]["conflicts"]
    if not left and not conflicts:
        lines.append("converged")
    else:
        lines.append(f"NOT converged: {len(left)} step(s), {len(conflicts)} conflict(s) left")
        lines += [f"CONFLICT {c}" for c in conflicts]
    return "\n".join(lines)


def _render_status(s: dict[str, Any]) -> str:
    if s["in_sync"]:
        return "in sync"
    lines = [f"missing {m}" for m in s["missing"]] + [f"extra {x}" for x in s["extra"]]
    return "\n".join(lines + [f"changed {c}" for c in s["changed"]])


@click.group(
    "spdk", help="Drive SPDK on the DPU: desired state ([spdk] in the config) -> plan -> apply."
)
def spdk_group() -> None:
    pass


@spdk_group.command("plan", help="Print the RPCs that would reconcile SPDK (keys redacted).")
@click.option(
    "--saved",
    default=None,
    type=_CONFIG,
    help="Plan offline against this saved config (save_config / spdk_tgt --json), no target.",
)
@_options
@_errors
def plan_cmd(
    config: str, socket: str | None, key_file: str | None, as_json: bool, saved: str | None
) -> None:
    p = ops.run_plan(config, socket, key_file, saved)
    show(p, as_json, _render_plan)
    sys.exit(EXIT_FAILED if p["conflicts"] else EXIT_OK)  # a plan apply would refuse


@spdk_group.command("apply", help="Run the plan; stop at the first SPDK error; re-plan.")
@_options
@_errors
def apply_cmd(config: str, socket: str | None, key_file: str | None, as_json: bool) -> None:
    result = ops.run_apply(config, socket, key_file)
    after = result["after"]
    result["converged"] = not after["steps"] and not after["conflicts"]
    show(result, as_json, _render_apply)
    sys.exit(EXIT_OK if result["converged"] else EXIT_FAILED)


@spdk_group.command("status", help="Drift report: objects created or removed behind our back.")
@_options
@_errors
def status_cmd(config: str, socket: str | None, key_file: str | None, as_json: bool) -> None:
    report = ops.run_status(config, socket, key_file)
    show(report, as_json, _render_status)
    sys.exit(EXIT_OK if report["in_sync"] else EXIT_FAILED)


@spdk_group.command("boot-config", help="The SPDK JSON config (spdk_tgt --json) a DPU boots with.")
@click.option("--config", "config", required=True, envvar="DPUKV_CONFIG", type=_CONFIG)
@click.option("--output", default=None, help="Write here instead of stdout.")
@click.option("--with-keys", is_flag=True, help="Real key material (needs --output; 0600).")
@click.option("--key-file", default=None, help="Agent key file (default: environment).")
@click.option("--provisioned", is_flag=True, help="The drive already holds the lvstores.")
@click.option("--json", "as_json", is_flag=True, help="Errors as JSON too.")
@_errors
def boot_config_cmd(
    config: str,
    output: str | None,
    with_keys: bool,
    key_file: str | None,
    provisioned: bool,
    as_json: bool,
) -> None:
    doc = ops.run_boot_config(
        config, output, with_keys=with_keys, key_file=key_file, provisioned=provisioned
    )
    click.echo(json.dumps(doc, indent=2) if output is None or with_keys else f"wrote {output}")


@spdk_group.command("tiers", help="Per tenant: subsystem, loopback listener, nsid of each tier.")
@click.option("--config", "config", required=True, envvar="DPUKV_CONFIG", type=_CONFIG)
@click.option("--json", "as_json", is_flag=True)
@_errors
def tiers_cmd(config: str, as_json: bool) -> None:
    show(
        ops.run_tiers(config),
        as_json,
        lambda ts: "\n".join(
            f"{t['tenant']:12} {t['tier']:5} nsid {t['nsid']} {t['subnqn']} "
            f"{t['traddr']}:{t['trsvcid']}"
            for t in ts
        ),
    )
