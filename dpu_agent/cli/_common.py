"""What every dpuctl command group shares: the error exit (JSON under --json)."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

__all__ = ["fail"]


def fail(exit_code: int, message: str, as_json: bool, **extra: Any) -> NoReturn:
    """Print the error (under --json a JSON object with `extra` fields) and exit."""
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message, "exit_code": exit_code, **extra}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(exit_code)
