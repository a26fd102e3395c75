"""Waiting in tests: polls with deadlines, never a bare sleep before an assertion.

A sleep guesses how long the system needs; on a loaded box (2 cores, 8 engineers) the guess is
wrong and a negative assertion ("nothing happened") passes because nothing had happened *yet*.
So a test waits for a positive event that proves its input was processed (a reply, a log line,
a counter, a closed socket), with a deadline generous enough for a loaded box, and only then
asserts what must be absent. docs/TESTING.md says the same for people writing tests.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["POLL_INTERVAL_S", "WAIT_S", "wait_closed", "wait_until"]

T = TypeVar("T")

# Between two looks at the condition: short against every deadline here, long enough that a
# poll does not take a core from the process it waits for.
POLL_INTERVAL_S = 0.02
# A deadline for things that take milliseconds when idle; a loaded CI box has been seen to
# stretch those a hundredfold, and a deadline only costs time when the test is failing.
WAIT_S = 20.0


def wait_until(
    check: Callable[[], T],
    what: str,
    timeout_s: float = WAIT_S,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """`check()`'s first truthy value, polled every `interval_s`; AssertionError naming `what`
    once `timeout_s` passed without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def wait_closed(socks: Iterable[socket.socket], timeout_s: float = WAIT_S) -> list[socket.socket]:
    """Wait until the peer closed each of `socks` (EOF or a reset; any bytes it sent first are
    read and dropped). Returns the ones still open at the deadline (empty: all closed)."""
    open_ = list(socks)
    deadline = time.monotonic() + timeout_s
    while open_:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(open_, [], [], min(left, 1.0))
        for s in readable:
            try:
                closed = s.recv(1 << 16) == b""
            except OSError:  # reset by the peer
                closed = True
            if closed:
                open_.remove(s)
    return open_
