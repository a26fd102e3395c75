"""sd_notify: datagrams to a real AF_UNIX socket, and an agent under "systemd" (NOTIFY_SOCKET,
WATCHDOG_USEC) sending READY=1, watchdog pings and STOPPING=1."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.sdnotify import notify, watchdog_interval_s
from dpu_agent.testing import spawn_agent

RECV_TIMEOUT_S = 60.0  # an agent's first start on a loaded 2-core machine


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    s.settimeout(RECV_TIMEOUT_S)
    yield s, path
    s.close()


def test_notify_sends_one_datagram_to_a_path_socket(listener: tuple[socket.socket, str]) -> None:
    s, path = listener
    assert notify("READY=1\nSTATUS=x", {"NOTIFY_SOCKET": path})
    assert s.recv(4096) == b"READY=1\nSTATUS=x"


def test_notify_abstract_socket() -> None:
    name = f"dpukv-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        assert notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(64) == b"WATCHDOG=1"


def test_not_under_systemd_is_a_no_op(tmp_path: Path) -> None:
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})  # refused


def test_watchdog_interval_is_half_the_timeout_for_this_process_only() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert (
        watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 1.0
    )
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None and watchdog_interval_s({"WATCHDOG_USEC": "x"}) is None


@pytest.mark.slow
def test_agent_under_systemd_sends_ready_pings_and_stopping(
    listener: tuple[socket.socket, str], tmp_path: Path
) -> None:
    s, path = listener
    agent = spawn_agent(tmp_path / "var", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    try:
        first = s.recv(4096).decode()
        assert first.startswith("READY=1\n") and f"MAINPID={agent.proc.pid}" in first
        t0 = time.monotonic()
        pings = [s.recv(64) for _ in range(3)]
        assert pings == [b"WATCHDOG=1"] * 3
        assert time.monotonic() - t0 < 10  # every 0.2 s, not once
    finally:
        code = agent.stop()
    messages = []
    s.settimeout(5)
    while True:
        try:
            messages.append(s.recv(64))
        except TimeoutError:
            break
        if messages[-1] == b"STOPPING=1":
            break
    assert code == 0 and b"STOPPING=1" in messages
