"""A monotonic clock of the time this process ran, for deadlines that blame a peer.

A deadline on `time.monotonic()` also counts time the agent itself did not run: stopped
(SIGSTOP, a debugger), its VM or container paused, its Arm cores starved. On waking, every
transfer in flight looks late, and the agent blames the peer for its own pause (seen: a NIXL
worker replaced and a tenant refused NIXL for 60 s after the agent was stopped for 5 s mid-put).
`run_clock()` stops while the process does not run: a daemon thread ticks every TICK_S, and a
tick later than TICK_S + SLACK_S means the process did not run for the excess, which the clock
leaves out. The lateness of a tick that is due counts before the ticker wakes, so a thread that
wakes from a pause before the ticker does still sees no time pass.

What it cannot tell apart: a process that runs but whose ticker is starved of the GIL for longer
than SLACK_S (a C call holding it) counts that time as a pause too, so a deadline then fires a
little late, never early.
"""

from __future__ import annotations

import os
import threading
import time

from dpu_agent.log import get_logger

log = get_logger("dpu_agent.runclock")

TICK_S = 0.1
# A tick's ordinary lateness: the GIL's switch interval (5 ms), the scheduler on a loaded box
# (tens of ms). Larger: a pause counts up to this much against a deadline.
SLACK_S = 0.25
_ALLOWED_S = TICK_S + SLACK_S
PAUSE_LOGGED_S = 1.0  # a pause this long goes to the log: it explains what follows it

# (monotonic time of the last tick, seconds not run before it): one tuple, replaced whole, so a
# reader never sees half of an update
_state = (time.monotonic(), 0.0)
_started = False
_start_lock = threading.Lock()


def _tick() -> None:
    global _state
    while True:
        time.sleep(TICK_S)
        now = time.monotonic()
        last, paused = _state
        lost = max(0.0, now - last - _ALLOWED_S)
        _state = (now, paused + lost)
        if lost >= PAUSE_LOGGED_S:
            log.warning("agent_did_not_run", seconds=round(lost, 2),
                        effect="deadlines in flight do not count it")  # fmt: skip


def _start() -> None:
    global _started, _state
    with _start_lock:
        if not _started:
            _state = (time.monotonic(), _state[1])
            threading.Thread(target=_tick, name="run-clock", daemon=True).start()
            _started = True


def _forked() -> None:
    """A forked child has no ticker thread: it starts its own on first use."""
    global _started, _start_lock
    _started, _start_lock = False, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def run_clock() -> float:
    """Seconds, like time.monotonic(), that do not advance while this process is not running."""
    if not _started:
        _start()
    now = time.monotonic()
    last, paused = _state
    return now - paused - max(0.0, now - last - _ALLOWED_S)
