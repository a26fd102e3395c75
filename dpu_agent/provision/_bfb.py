"""Run `bfb-install` and turn its output into progress: the installer's
`BFB-Installer: Installing <step> passed|failed, total N% complete` lines, and the rshim
console's "Rebooting...", "Linux up", "DPU is ready", "CRITICAL ERROR" (BLUEFIELD.md)."""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BFB_INSTALL_TIMEOUT_S",
    "BfbInstallError",
    "BfbProgress",
    "bfb_install_argv",
    "parse_progress",
    "run_bfb_install",
]

# Flashing a BFB (~1.5 GiB over rshim) and the first boot take 10-30 minutes; bounded anyway.
BFB_INSTALL_TIMEOUT_S = 3600.0
TAIL_LINES_MAX = 40  # what an error report quotes of the installer's output
_STEP_RE = re.compile(
    r"BFB-Installer: Installing (?P<step>.+?) (?P<result>passed|failed), "
    r"total (?P<pct>\d{1,3})% complete"
)
_RSHIM_RE = re.compile(r"(?P<event>Rebooting\.\.\.|Linux up|DPU is ready|CRITICAL ERROR.*)")
_RSHIM_NAME_RE = re.compile(r"^(?:(?P<host>[^:]+)(?::(?P<port>\d+))?:)?rshim\d+$")


class BfbInstallError(Exception):
    """bfb-install is missing, refused its arguments, or the install failed."""

    def __init__(self, message: str, returncode: int | None = None, tail: Iterable[str] = ()):
        self.returncode, self.tail = returncode, list(tail)
        super().__init__(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class BfbProgress:
    percent: int | None  # None: an event without a percentage
    step: str
    failed: bool = False


def parse_progress(line: str) -> BfbProgress | None:
    m = _STEP_RE.search(line)
    if m:
        pct = min(int(m["pct"]), 100)
        return BfbProgress(percent=pct, step=m["step"], failed=m["result"] == "failed")
    e = _RSHIM_RE.search(line)
    if e:
        event = e["event"]
        return BfbProgress(percent=100 if event == "DPU is ready" else None, step=event,
                           failed=event.startswith("CRITICAL ERROR"))  # fmt: skip
    return None


def bfb_install_argv(bfb: Path, rshim: str, bf_cfg: Path, exe: str = "bfb-install") -> list[str]:
    if not _RSHIM_NAME_RE.match(rshim):
        raise BfbInstallError(f"--rshim {rshim!r}: expected rshimN or HOST[:PORT]:rshimN")
    return [exe, "--bfb", str(bfb), "--rshim", rshim, "--config", str(bf_cfg)]


def run_bfb_install(
    argv: list[str],
    on_progress: Callable[[BfbProgress], None],
    timeout_s: float = BFB_INSTALL_TIMEOUT_S,
) -> list[str]:
    """Run bfb-install, report progress lines as they come; the output tail on success."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise BfbInstallError(
            f"{argv[0]} not found: install NVIDIA's rshim package (it ships bfb-install) on the "
            "host the DPU's rshim is attached to, or pass --bfb-install PATH"
        )
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES_MAX)
    failed = False
    killed = threading.Event()
    with subprocess.Popen([exe, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:  # fmt: skip
        assert proc.stdout is not None

        def kill() -> None:  # a silent, hung installer too
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            for line in proc.stdout:
                tail.append(line.rstrip())
                event = parse_progress(line)
                if event is not None:
                    failed = failed or event.failed
                    on_progress(event)
            code = proc.wait()
        finally:
            timer.cancel()
    if killed.is_set():
        raise BfbInstallError(f"bfb-install ran over {timeout_s:.0f} s; killed", code, tail)
    if code != 0 or failed:
        raise BfbInstallError(f"bfb-install failed (exit {code})", code, tail)
    return list(tail)
