"""dpu_agent/runclock.py: a clock that stops while the process does not run, checked on a real
stopped process (SIGSTOP from here), not on a patched time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpu_agent.runclock import run_clock

ROOT = Path(__file__).resolve().parent.parent
# A child answering each line with "run_clock monotonic"
CHILD = """
import sys, time
from dpu_agent.runclock import run_clock
run_clock()
for line in sys.stdin:
    print(run_clock(), time.monotonic(), flush=True)
"""
PAUSE_S = 1.5


def _ask(p: subprocess.Popen[str]) -> tuple[float, float]:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("now\n")
    p.stdin.flush()
    run, mono = p.stdout.readline().split()
    return float(run), float(mono)


def test_run_clock_leaves_out_a_stop_and_keeps_time_while_running() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        r0, m0 = _ask(p)
        time.sleep(1.0)  # running: the clock keeps real time
        r1, m1 = _ask(p)
        assert 0.9 <= r1 - r0 <= m1 - m0 + 0.01  # each read is a moment before its monotonic one
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(p.pid, signal.SIGCONT)
        r2, m2 = _ask(p)  # the main thread may wake before the ticker: it sees no pause either
        assert m2 - m1 >= PAUSE_S
        assert r2 - r1 < 0.5, (r2 - r1, m2 - m1)  # at most TICK_S + SLACK_S of it counted
        time.sleep(0.5)
        r3, m3 = _ask(p)  # after the pause, time runs again
        assert 0.4 <= r3 - r2 <= m3 - m2 + 0.01
    finally:
        p.kill()
        p.wait()


def test_run_clock_never_goes_back() -> None:
    last, end = run_clock(), time.monotonic() + 0.5
    while time.monotonic() < end:
        now = run_clock()
        assert now >= last
        last = now
