"""dpuctl's error exit is written once (dpu_agent/cli/_common.py): there were three `_fail`
and three `_errors` copies, which had drifted (one escaped rich markup, one did not; one
showed a tool's output tail, the others dropped it)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import click
from click.testing import CliRunner

from dpu_agent.cli._common import exits_on, fail, plan_conflicts

CLI = Path(__file__).resolve().parents[1] / "dpu_agent" / "cli"


class _Conflict(Exception):
    conflicts = ("a", "b")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--raise", "what", default="")
@exits_on(
    (KeyError, 4, None),
    (_Conflict, 1, plan_conflicts),
    (LookupError, 3, lambda e: ("looked", {"tail": ["l1", "l2"]})),
)
def _cmd(as_json: bool, what: str) -> None:
    if what == "key":
        raise KeyError("[storage] dir")
    if what == "conflict":
        raise _Conflict("2 steps")
    if what == "lookup":
        raise IndexError("x")
    if what == "other":
        raise RuntimeError("not mapped")
    if what == "fail":
        fail(5, "plain [red]text[/red]", as_json, step="s")
    click.echo("ok")


def test_first_matching_rule_exits_with_its_code_and_extras() -> None:
    r = CliRunner().invoke(_cmd, ["--json", "--raise", "conflict"])
    assert r.exit_code == 1
    assert json.loads(r.stdout) == {
        "ok": False,
        "error": "plan has conflicts: 2 steps",
        "exit_code": 1,
        "conflicts": ["a", "b"],
    }
    r = CliRunner().invoke(_cmd, ["--raise", "key"])  # KeyError before its base LookupError
    assert r.exit_code == 4 and "error: '[storage] dir'" in r.stderr
    r = CliRunner().invoke(_cmd, ["--raise", "lookup"])
    assert r.exit_code == 3 and "error: looked\n  | l1\n  | l2" in r.stderr


def test_unmapped_errors_propagate_and_markup_is_text() -> None:
    r = CliRunner().invoke(_cmd, ["--raise", "other"])
    assert isinstance(r.exception, RuntimeError)
    r = CliRunner().invoke(_cmd, ["--raise", "fail"])
    assert r.exit_code == 5 and "error: plain [red]text[/red]" in r.stderr
    assert CliRunner().invoke(_cmd, []).stdout == "ok\n"


def test_no_command_group_defines_its_own_error_exit() -> None:
    own = [
        f"{path.name}:{node.name}"
        for path in sorted(CLI.glob("*.py"))
        if path.name != "_common.py"
        for node in ast.parse(path.read_text()).body  # a module's own helpers, not a callback
        if isinstance(node, ast.FunctionDef) and node.name.strip("_") in ("fail", "errors", "show")
    ]
    assert not own, own
