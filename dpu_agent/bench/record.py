"""Recorded runs: `dpuctl bench --record docs/bench/NAME.json BENCH ... --json` writes the
bench's --json report wrapped with where and when it ran, the form docs/BENCHMARKS.md is
generated from (dpu_agent/bench/doc.py):

    {"meta": {"command": "<the dpuctl command line>", "date_utc": "...", "loadavg_1m": 0.5,
              "cpus": 2, "commit": "<git HEAD or null>", ...},
     "report": <the bench's --json output, unchanged>}

The bench's stdout is kept as it is (it is captured, then printed): scripts that parse
`--json` read the same bytes with or without --record. A report that says it failed
(`"ok": false`, or an `error`) is not recorded: a recorded run is one that measured.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["META_KEYS", "RecordError", "captured_stdout", "meta", "parse_report", "write_record"]

META_KEYS = ("command", "date_utc", "loadavg_1m", "cpus", "commit")  # every record has these
GIT_TIMEOUT_S = 10.0  # `git rev-parse HEAD` answers in milliseconds; a hung git is not waited on
REPORT_BYTES_MAX = 64 << 20  # a --json report is kilobytes; more is not a report


class RecordError(Exception):
    """The run cannot be recorded (no JSON report, or a report that says it failed)."""


def _commit(cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def meta(argv: list[str], *, now: datetime.datetime | None = None) -> dict[str, Any]:
    """Where and when a run starts: the load is the 1-minute average when the bench begins
    (what the machine's other jobs put on it), `loadavg_1m_end` is added when it ends."""
    now = now or datetime.datetime.now(datetime.UTC)
    return {
        "command": shlex.join(["dpuctl", *argv]),
        "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count() or 1,
        "commit": _commit(Path(__file__).resolve().parent),
    }


def parse_report(stdout: str) -> Any:
    """The bench's --json report from what it printed: the whole output, else its last line
    (a bench that printed a line of progress before its one-line report)."""
    if len(stdout) > REPORT_BYTES_MAX:
        raise RecordError(f"the bench printed {len(stdout)} bytes: not a --json report")
    text = stdout.strip()
    candidates = [text] + ([text.splitlines()[-1]] if text else [])
    for candidate in candidates:
        try:
            report = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(report, dict) and (report.get("ok") is False or "error" in report):
            raise RecordError(f"the bench failed, nothing recorded: {report.get('error')}")
        return report
    raise RecordError("the bench printed no JSON report: --record needs the bench's --json")


def write_record(path: Path, run_meta: dict[str, Any], report: Any) -> None:
    """Writes {"meta", "report"} to `path` (whole or not at all: a temporary file renamed)."""
    run_meta = {**run_meta, "loadavg_1m_end": round(os.getloadavg()[0], 2)}
    body = json.dumps({"meta": run_meta, "report": report}, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(body)
    os.replace(tmp, path)


@contextlib.contextmanager
def captured_stdout(echo: Callable[[str], None]) -> Iterator[Callable[[], str]]:
    """Runs the body with sys.stdout captured; what it printed is passed to `echo` after it
    ends (also when it fails), and the returned getter reads it."""
    buf = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    real = sys.stdout
    sys.stdout = buf
    try:
        yield lambda: buf.buffer.getvalue().decode("utf-8")
    finally:
        sys.stdout = real
        echo(buf.buffer.getvalue().decode("utf-8"))
