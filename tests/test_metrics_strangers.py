"""Strangers on the metrics port hold neither threads nor descriptors (dpu_agent.metrics_server).

Found attacking the agent: prometheus_client's `start_http_server` starts a thread per
connection and waits on each for as long as the peer likes. 1,000 idle sockets held 1,000
threads in the agent and made a scrape's connect wait in the listen backlog; enough of them take
the descriptors the journal and the tenants' connections need. On a DPU the metrics port faces
the management network.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge

from dpu_agent.metrics import sample_value
from dpu_agent.metrics_server import (
    METRICS_CONNECTIONS_MAX,
    METRICS_CONNECTIONS_PER_ADDRESS_MAX,
    MetricsServer,
    start_metrics_server,
)
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

FLOOD = 400  # idle sockets from one address (the old agent: a thread each)
LAYOUT = ChunkLayout("metrics-test", "float16", num_layers=2, num_kv_heads=2, head_dim=64,
                     chunk_tokens=16)  # fmt: skip
SALT = b"metrics-strangers"


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _scrape(port: int, source: str = "127.0.0.1") -> str:
    with _connect(port, source) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head[:100]
    return body.decode()


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    reg = CollectorRegistry()
    Gauge("strangers_test_up", "a series to scrape", registry=reg).set(1)
    srv = start_metrics_server("127.0.0.1", 0, reg)
    srv.deadline_s = 1.0  # the instance's, so the test waits 1 s, not 10
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _port(srv: MetricsServer) -> int:
    return int(srv.server_address[1])


def test_a_scrape_gets_the_registry(server: MetricsServer) -> None:
    assert "strangers_test_up 1.0" in _scrape(_port(server))


def test_silent_and_trickling_connections_are_closed_at_the_deadline(
    server: MetricsServer,
) -> None:
    port = _port(server)
    before = sample_value("kvtier_metrics_connections_closed_total", {"reason": "deadline"})
    silent = _connect(port)
    trickle = _connect(port)
    t0 = time.monotonic()
    closed_at: float | None = None
    trickle.settimeout(0.2)
    try:
        for _ in range(40):  # 8 s at most; the deadline is 1 s
            try:
                trickle.sendall(b"G")  # one byte of a request line every 0.2 s
                if trickle.recv(1) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server's shutdown
                closed_at = time.monotonic() - t0
                break
        assert closed_at is not None and closed_at < 3.0, closed_at
        silent.settimeout(3)
        assert _closed_by_server(silent)
    finally:
        silent.close()
        trickle.close()
    after = sample_value("kvtier_metrics_connections_closed_total", {"reason": "deadline"})
    assert after - before >= 2
    assert "strangers_test_up" in _scrape(port)


def test_strangers_from_many_addresses_never_keep_a_scraper_out(server: MetricsServer) -> None:
    port = _port(server)
    addresses = [f"127.0.0.{i}" for i in range(2, 2 + METRICS_CONNECTIONS_MAX // 4)]
    held = [
        _connect(port, a) for a in addresses for _ in range(METRICS_CONNECTIONS_PER_ADDRESS_MAX)
    ]
    try:
        time.sleep(0.3)  # let the server accept them all
        assert server.open_connections() <= METRICS_CONNECTIONS_MAX
        # a scraper from an address of its own gets in: the oldest stranger makes room
        assert "strangers_test_up" in _scrape(port, "127.0.0.250")
        assert server.open_connections() <= METRICS_CONNECTIONS_MAX
    finally:
        for s in held:
            s.close()


def test_an_agent_flooded_on_its_metrics_port_holds_few_threads_and_serves(tmp_path: Path) -> None:
    agent: AgentProcess = spawn_agent(tmp_path / "agent")
    try:
        port = int(agent.metrics_url.rsplit(":", 1)[1].split("/")[0])
        base = _threads(agent.proc.pid)
        held = []
        try:
            for _ in range(FLOOD):
                held.append(_connect(port))
            time.sleep(0.5)
            # the old agent: a thread per idle socket (400 + base)
            assert _threads(agent.proc.pid) <= base + METRICS_CONNECTIONS_PER_ADDRESS_MAX + 4
            assert "kvtier_metrics_connections_closed_total" in _scrape(port)  # same address
            assert "kvtier_control_requests_total" in _scrape(port, "127.0.0.2")
            tokens = list(range(4 * LAYOUT.chunk_tokens))
            chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(4)]
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(4)]
            with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
                assert c.put(tokens, chunks) == 4
                assert c.get(tokens, out) == 4
            assert all(np.array_equal(a, b) for a, b in zip(chunks, out, strict=True))
            body = _scrape(port, "127.0.0.3")
            name = 'kvtier_metrics_connections_closed_total{reason="address_max"}'
            line = next(x for x in body.splitlines() if x.startswith(name))
            assert float(line.split()[1]) >= FLOOD - METRICS_CONNECTIONS_PER_ADDRESS_MAX
        finally:
            for s in held:
                s.close()
    finally:
        assert agent.stop() == 0
