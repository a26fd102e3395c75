"""structlog configured once for the whole agent and CLI.

JSON lines on stderr by default (what a DPU's journald or Fluent Bit ingests); `console=True`
gives a human rendering for `make run`. Never log secrets or bulk data.

A server's log is never a reason to stop serving: `lossy_std_streams()` (the agent, the
standalone target) replaces stdout and stderr with `LossyLineStream`s, which drop what cannot be
written now (a full disk, a log reader gone or stalled) instead of raising into, or blocking,
the thread that logged, and say how many lines went when writing works again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
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
    # force: a get_logger() at import configured the root logger on the stderr of that time
    logging.basicConfig(
        level=numeric_level, stream=sys.stderr, format="%(name)s %(message)s", force=True
    )
    _configured = True


# One write of at most a pipe's atomic size: a line that fits goes out whole or not at all
WRITE_CHUNK_BYTES_MAX = select.PIPE_BUF
# How long a log line may wait for a stalled reader (a pipe or socket whose reader stopped
# reading) before it is dropped; the lines after it, until one goes out, do not wait at all
LOG_WRITE_WAIT_S = 0.05
# A write() without a newline is held until its line ends; more than this is written as is
PENDING_BYTES_MAX = 64 * 1024


class LossyLineStream(io.TextIOBase):
    """A text stream on a file descriptor that never raises or blocks on a failing writer.

    Whole lines go out with os.write, in pieces of at most WRITE_CHUNK_BYTES_MAX, each after
    the descriptor polls writable within LOG_WRITE_WAIT_S. What cannot be written (any OSError:
    a full disk, a closed pipe, a failed device; or no room in time) is dropped and counted;
    the first line that goes out afterwards is preceded by a `log_lines_dropped` line with the
    count. Memory is bounded: at most PENDING_BYTES_MAX of an unfinished line is held."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd = fd
        self.name = name
        self._lock = threading.RLock()  # a signal handler that logs mid-write
        self._pending = bytearray()
        self._dropped_unreported = 0
        self._dropped_total = 0
        self._midline = False  # a line was cut after part of it went out

    @property
    def encoding(self) -> str:  # type: ignore[override]  # read-only on io.TextIOBase
        return "utf-8"

    @property
    def dropped_lines(self) -> int:
        return self._dropped_total

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        data = s.encode("utf-8", "backslashreplace")
        with self._lock:
            self._pending += data
            end = self._pending.rfind(b"\n") + 1
            if end == 0 and len(self._pending) > PENDING_BYTES_MAX:
                end = len(self._pending)
            if end:
                out = bytes(self._pending[:end])
                del self._pending[:end]
                self._emit(out)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                out = bytes(self._pending)
                self._pending.clear()
                self._emit(out)

    def _emit(self, data: bytes) -> None:
        if self._dropped_unreported:
            notice = json.dumps({
                "event": "log_lines_dropped", "lines": self._dropped_unreported,
                "reason": "the log could not be written (full disk, reader gone or stalled)",
                "level": "warning",
                "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            })  # fmt: skip
            head = (b"\n" if self._midline else b"") + notice.encode() + b"\n"
            sent = self._write_all(head)
            if sent < len(head):
                self._midline = self._midline or sent > 0
                self._drop(data)
                return
            self._midline, self._dropped_unreported = False, 0
        written = self._write_all(data)
        if written < len(data):
            self._midline = written > 0
            self._drop(data[written:])

    def _drop(self, data: bytes) -> None:
        lines = max(data.count(b"\n"), 1)
        self._dropped_unreported += lines
        self._dropped_total += lines

    def _write_all(self, data: bytes) -> int:
        """Bytes of `data` written before the descriptor failed or stayed full."""
        done = 0
        view = memoryview(data)
        # while lines are being dropped, none waits: one wait per stall, not one per line
        wait_s = 0.0 if self._dropped_unreported else LOG_WRITE_WAIT_S
        while done < len(data):
            try:
                ready = select.select([], [self._fd], [], wait_s)[1]
                if not ready:
                    return done
                done += os.write(self._fd, view[done : done + WRITE_CHUNK_BYTES_MAX])
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return done
        return done


def lossy_std_streams() -> tuple[LossyLineStream, LossyLineStream]:
    """Replace sys.stdout and sys.stderr with LossyLineStreams on descriptors 1 and 2 (a
    server's: the agent, the standalone target); call before configure_logging. Idempotent."""
    streams = []
    for attr, fd in (("stdout", 1), ("stderr", 2)):
        current = getattr(sys, attr)
        if isinstance(current, LossyLineStream):
            streams.append(current)
            continue
        try:
            current.flush()
        except (OSError, ValueError):
            pass
        stream = LossyLineStream(fd, f"<{attr}>")
        setattr(sys, attr, stream)
        streams.append(stream)
    return streams[0], streams[1]


def dropped_log_lines() -> int:
    """Log lines this process could not write (0 unless lossy_std_streams() was installed)."""
    return sum(s.dropped_lines for s in (sys.stdout, sys.stderr) if isinstance(s, LossyLineStream))


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
