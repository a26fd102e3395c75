"""What every dpuctl command group shares: the error exit (JSON under --json) and the mapping
of a command's exceptions to exit codes."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.markup import escape

__all__ = ["exits_on", "fail", "plan_conflicts", "show"]

F = TypeVar("F", bound=Callable[..., Any])
# (exception types, exit code, what to say: the message and the JSON's extra fields; None: str(e))
ExitRule = tuple[
    type[Exception] | tuple[type[Exception], ...],
    int,
    Callable[[Any], tuple[str, dict[str, Any]]] | None,
]
TAIL_LINES_MAX = 10  # lines of a failed tool's output shown under the error (`tail` extra)

_err = Console(stderr=True)


def fail(exit_code: int, message: str, as_json: bool, **extra: Any) -> NoReturn:
    """Print the error (under --json a JSON object with `extra` fields) and exit. A `tail`
    extra (a failed tool's last lines of output) is shown under the message too."""
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message, "exit_code": exit_code, **extra}))
    else:  # escape: a message naming "[storage] key" is text, not rich markup
        _err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        for line in extra.get("tail", [])[-TAIL_LINES_MAX:]:
            _err.print(f"  | {line}", highlight=False, markup=False, soft_wrap=True)
    sys.exit(exit_code)


def show(doc: Any, as_json: bool, render: Callable[[Any], str]) -> None:
    """A command's result: indented JSON under --json, else `render(doc)`."""
    click.echo(json.dumps(doc, indent=2) if as_json else render(doc))


def plan_conflicts(e: Any) -> tuple[str, dict[str, Any]]:
    """A plan with conflicts (NetConflict, FirmwareConflict, PlanConflict): each listed."""
    return f"plan has conflicts: {e}", {"conflicts": list(e.conflicts)}


def exits_on(*rules: ExitRule) -> Callable[[F], F]:
    """A command decorator: the first rule whose types match the exception raised exits with
    its code (`fail`, JSON when the command got `as_json`); anything else propagates."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                for types, code, describe in rules:
                    if isinstance(e, types):
                        message, extra = describe(e) if describe else (str(e), {})
                        fail(code, message, bool(kwargs.get("as_json")), **extra)
                raise

        return wrapper  # type: ignore[return-value]

    return decorate
