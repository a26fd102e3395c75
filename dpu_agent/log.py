"""structlog configured once for the whole agent and CLI.

JSON lines on stderr by default (what a DPU's journald or Fluent Bit ingests); `console=True`
gives a human rendering for `make run`. Never log secrets or bulk data.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

_configured = False


def configure_logging(*, level: str = "INFO", console: bool = False) -> None:
    """Configure structlog and the stdlib root logger. Safe to call more than once."""
    global _configured
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(name)s %(message)s")
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure_logging()
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


def nqn_tag(nqn: str) -> str:
    """A short stable name for a host NQN in logs. Logs never carry the NQN itself: until a
    host proves who it is cryptographically, knowing a tenant's host NQN is a step towards its
    data, and logs are read by more people than the data."""
    return "nqn#" + hashlib.blake2b(nqn.encode(), digest_size=6).hexdigest()


# Lines one refusal event may log per window; the rest are counted and the count goes out
# with the next line. A flood of bad peers then costs a few lines a second, not a line each.
REFUSAL_LINES_PER_WINDOW_MAX = 10
REFUSAL_WINDOW_S = 1.0


class RateLimitedLog:
    """Refusal logs (bad frames, failed logins, refused connections) with a budget per event
    name: at most REFUSAL_LINES_PER_WINDOW_MAX lines per REFUSAL_WINDOW_S, then one line with
    `suppressed=N` when the window turns."""

    def __init__(self, logger: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self._windows: dict[str, list[float]] = {}  # event -> [window start, lines, suppressed]

    def warning(self, event: str, **fields: Any) -> bool:
        """Log unless over budget; returns whether a line went out."""
        now = self._clock()
        w = self._windows.get(event)
        if w is None or now - w[0] >= REFUSAL_WINDOW_S:
            suppressed = int(w[2]) if w is not None else 0
            w = self._windows[event] = [now, 0.0, 0.0]
            if suppressed:
                fields["suppressed"] = suppressed
        if w[1] >= REFUSAL_LINES_PER_WINDOW_MAX:
            w[2] += 1
            return False
        w[1] += 1
        self._log.warning(event, **fields)
        return True
