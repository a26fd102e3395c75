"""An exclusive flock around each measured step of a long benchmark on a shared machine.

A benchmark that runs for many minutes should not hold a machine-wide lock all that time, and
must not measure while another benchmark runs: each step (a turn, a history point) takes the
lock and releases it after, so other benchmarks run between steps and never during one.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

__all__ = ["bench_lock"]


@contextlib.contextmanager
def bench_lock(path: Path | None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block; None: no lock."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks while another holder measures
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
