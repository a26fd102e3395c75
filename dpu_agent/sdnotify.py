"""systemd's notify protocol (sd_notify(3)), implemented here: one datagram per message to
the AF_UNIX socket in $NOTIFY_SOCKET (a path, or "@name" for the abstract namespace).

The agent sends READY=1 once it serves, WATCHDOG=1 every half of $WATCHDOG_USEC from its
event loop (a blocked loop stops the pings and systemd restarts the agent), STOPPING=1 on
shutdown. Without $NOTIFY_SOCKET (not under systemd) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping

from dpu_agent.log import get_logger

__all__ = ["Notifier", "notify", "watchdog_interval_s"]

_log = get_logger("dpu_agent.sdnotify")
MESSAGE_BYTES_MAX = 4096  # READY=1, STATUS=... lines; systemd reads up to its page size
WATCHDOG_FRACTION = 0.5  # ping at half the timeout, as sd_watchdog_enabled(3) advises


def _address(environ: Mapping[str, str]) -> str | None:
    addr = environ.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return None  # unset, or a vsock address this agent does not speak
    return "\0" + addr[1:] if addr[0] == "@" else addr


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send one message; False when not under systemd or the socket refused it."""
    addr = _address(os.environ if environ is None else environ)
    if addr is None:
        return False
    data = message.encode()
    assert len(data) <= MESSAGE_BYTES_MAX, len(data)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(data, addr)
    except OSError as e:
        _log.warning("sd_notify_failed", error=str(e))
        return False
    return True


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings, or None when systemd asks for none (or for another process)."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0"))
    except ValueError:
        return None
    if usec <= 0 or (pid and pid != os.getpid()):
        return None
    return usec / 1e6 * WATCHDOG_FRACTION


class Notifier:
    """READY, then watchdog pings from the running event loop, then STOPPING."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = dict(os.environ if environ is None else environ)
        self._task: asyncio.Task[None] | None = None

    def ready(self, status: str) -> None:
        notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}", self._environ)
        interval = watchdog_interval_s(self._environ)
        if interval is not None and _address(self._environ) is not None:
            self._task = asyncio.get_running_loop().create_task(self._pings(interval))

    async def _pings(self, interval_s: float) -> None:
        while True:
            notify("WATCHDOG=1", self._environ)
            await asyncio.sleep(interval_s)

    async def stopping(self) -> None:
        notify("STOPPING=1", self._environ)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
