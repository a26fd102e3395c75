"""Hostile suite, issue 10 findings 8-11: nobody unauthenticated can hurt the agent, and an
authenticated host cannot pin its memory.

Each test attacks on loopback, bounded in count and time, while a legitimate client keeps
working byte-exact, and checks the target's RSS stays under a stated bound. Targets run in a
child process (its RSS is the target's) or in-process where a deadline must be shortened.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from test_control_server import TOKENS, read_frame, serving
from waits import wait_closed, wait_until

import dpu_agent.control._server as control_server
import dpu_agent.nvmf._connection as nvmf_connection
from dpu_agent.blockdev import MemoryBlockDevice
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.log import REFUSAL_LINES_PER_WINDOW_MAX, RateLimitedLog
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, TargetOptions
from dpu_agent.nvmf._limits import CONTROLLER_BUFFER_BYTES_MAX, BufferBudget, SizedPool
from dpu_agent.testing import TargetProcess, rss_bytes
from host_shim.client import ControlChannel
from host_shim.nvme import NvmeTcpController
from kvproto.control import ADMIN_TENANT
from kvproto.nvme import DISCOVERY_NQN, R2T, CapsuleCmd, Cns, H2CData
from kvproto.nvme._commands import data_sgl, identify, write

NQN = "nqn.2026-11.io.dpu-kvtier:test:hostile"
HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 12)]  # ten source addresses on loopback
# RSS the target may gain under each attack (buffers, kernel queues, allocator slack): the
# attacks below took 0.8-1.5 GiB before the fixes.
RSS_GROWTH_BYTES_MAX = CONTROLLER_BUFFER_BYTES_MAX + (64 << 20)


def check_legit(ctrl: NvmeTcpController, round_: int) -> None:
    """A legitimate host writes and reads back 64 KiB byte-exact."""
    data = os.urandom(16) * 4096
    lba = 64 + (round_ % 8) * 16
    ctrl.write(1, lba, data)
    out = bytearray(len(data))
    ctrl.read(1, lba, out)
    assert bytes(out) == data


def open_from(address: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


# --- 8: pipelined Identify with 4 MiB SGLs on the discovery controller ----------------------


def test_pipelined_4mib_identify_cannot_grow_memory() -> None:
    with TargetProcess(NQN, allow_hosts=[HOST], max_io_size=4 << 20) as tgt:
        legit = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST)
        attacker = NvmeTcpController.connect("127.0.0.1", tgt.port, DISCOVERY_NQN,
                                             "nqn.attacker", keep_alive=False)  # fmt: skip
        try:
            before = rss_bytes(tgt.proc.pid)
            q = attacker._admin
            big = dataclasses.replace(identify(cid=0, cns=Cns.CONTROLLER),
                                      sgl=data_sgl(4 << 20, in_capsule=False))  # fmt: skip
            q._sock.settimeout(5)
            with contextlib.suppress(OSError):  # the target may stop reading: that is the fix
                for i in range(300):  # 1.2 GiB of replies before the fix; never read
                    cmd = dataclasses.replace(big, cid=100 + i % 20)
                    q._sock.sendall(b"".join(bytes(p) for p in q._qp.send(CapsuleCmd(sqe=cmd))))
            for r in range(10):
                check_legit(legit, r)
            time.sleep(0.5)
            grown = rss_bytes(tgt.proc.pid) - before
            assert grown < RSS_GROWTH_BYTES_MAX, f"target RSS grew {grown >> 20} MiB"
        finally:
            attacker.close()
            legit.close()
        assert tgt.alive()


# --- 10: unanswered R2Ts on many queues; buffers sized to the command ----------------------


def test_unanswered_r2ts_cannot_pin_memory_and_time_out(tmp_path: Path) -> None:
    # a file-backed namespace: writes go through the target's buffers (a memory device would
    # take the data in place, pinning nothing)
    with TargetProcess(NQN, allow_hosts=[HOST], max_io_size=4 << 20,
                       file=tmp_path / "ns.img") as tgt:  # fmt: skip
        legit = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST)
        hostile = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST, io_queues=48,
                                            queue_depth=32, keep_alive=True)  # fmt: skip
        try:
            before = rss_bytes(tgt.proc.pid)
            for q in hostile._io:  # 16 x 4 MiB writes per queue ...
                for i in range(16):
                    sqe = write(cid=200 + i, nsid=1, slba=1024, nlb=1024)
                    q._send(q._qp.send(CapsuleCmd(sqe=sqe)))
            sent = answer_r2ts_but_the_last_block(hostile)  # ... each R2T answered but 4 KiB
            assert sent <= HOSTILE_SEND_BYTES_MAX
            for r in range(10):
                check_legit(legit, r)
            grown = rss_bytes(tgt.proc.pid) - before
            assert grown < RSS_GROWTH_BYTES_MAX, f"target RSS grew {grown >> 20} MiB"
            deadline = time.monotonic() + 20  # R2T_TIMEOUT_S (10 s) + a loop period
            q = hostile._io[0]
            q._sock.settimeout(1)
            closed = False
            while time.monotonic() < deadline and not closed:
                try:
                    closed = q._sock.recv(65536) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
            assert closed, "a queue with an unanswered R2T was never closed"
            check_legit(legit, 11)
        finally:
            hostile.close()
            legit.close()
        assert tgt.alive()


HOSTILE_SEND_BYTES_MAX = 600 << 20  # the old target pinned all of it (48 queues x 8 x 4 MiB)
HOSTILE_SEND_S = 3.0


def answer_r2ts_but_the_last_block(ctrl: NvmeTcpController) -> int:
    """For every R2T the target sends, send all of its data but the last 4 KiB (the buffer
    is then resident and pinned); bounded in bytes and time. Returns the bytes sent."""
    sent = 0
    deadline = time.monotonic() + HOSTILE_SEND_S
    for q in ctrl._io:
        q._sock.setblocking(False)
    while time.monotonic() < deadline and sent < HOSTILE_SEND_BYTES_MAX:
        readable, _, _ = select.select([q._sock for q in ctrl._io], [], [], 0.2)
        for q in [q for q in ctrl._io if q._sock in readable]:
            try:
                n = q._sock.recv_into(q._qp.get_buffer())
            except BlockingIOError:
                continue
            q._qp.buffer_updated(n)
            while isinstance(ev := q._qp.next_event(), R2T):
                data = bytes(ev.r2tl - 4096)
                pdu = H2CData(cccid=ev.cccid, ttag=ev.ttag, datao=0, data=data, last=False)
                q._sock.setblocking(True)
                q._sock.sendall(b"".join(bytes(p) for p in q._qp.send(pdu)))
                q._sock.setblocking(False)
                sent += len(data)
    for q in ctrl._io:
        q._sock.setblocking(True)
    return sent


def test_io_buffers_are_sized_to_the_command() -> None:
    pool = SizedPool(4 << 20, 8)
    small = pool.take(16 << 10)
    assert small is not None and len(small) == 16 << 10  # not max_io_size
    odd = pool.take(20 << 10)
    assert odd is not None and len(odd) == 32 << 10
    pool.give(small)
    assert pool.take(16 << 10) is small  # reused


# --- 9: idle unauthenticated connections, control plane and NVMe/TCP ----------------------


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(EngineConfig(data_dir=tmp_path, dram_bytes=1 << 20, nvme_bytes=4 << 20,
                            tenants={n: 0 for n in TOKENS}))  # fmt: skip
    e.put_chunk("alpha", b"a" * 16, b"legit bytes " * 1000)
    try:
        yield e
    finally:
        e.close()


def test_idle_unauthenticated_control_connections_lock_nobody_out(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_server, "HELLO_DEADLINE_S", 1.0)
    sock_path = tmp_path / "ctl.sock"
    with serving(engine, connections_max=64, unix_path=sock_path) as srv:
        assert srv.tcp_address is not None
        port = srv.tcp_address[1]
        idle = [open_from(a, port) for a in ATTACKERS for _ in range(40)]  # 400 > every cap
        try:
            with ControlChannel(f"tcp://127.0.0.1:{port}", "alpha", TOKENS["alpha"]) as c:
                c.connect()  # a legitimate client still gets in ...
                hits = c.call("lookup", keys=[b"a" * 16], lease=False)["hits"]
                assert len(hits) == 1
            with ControlChannel(f"unix://{sock_path}", ADMIN_TENANT, "token-admin") as adm:
                adm.connect()  # ... and so does the admin, on its own Unix-socket slots
                assert adm.call("stats")["stats"]["records"] == 1
            # the hello deadline closes what never said hello
            assert wait_closed(idle) == [], "idle connections outlived the hello deadline"
            wait_until(lambda: len(srv.unauthenticated) == 0, "the server forgets them")
        finally:
            for s in idle:
                s.close()


def test_request_before_hello_is_answered_then_closed(engine: Engine) -> None:
    import msgpack

    with serving(engine) as srv:
        assert srv.tcp_address is not None
        with socket.create_connection(srv.tcp_address, timeout=5) as s:
            body = msgpack.packb({"id": 1, "op": "stats"})
            s.sendall(len(body).to_bytes(4, "big") + body)
            assert read_frame(s)["error"] == "auth"
            assert s.recv(1) == b""  # closed after the reply


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_idle_nvme_connections_are_closed_and_lock_nobody_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nvmf_connection, "CONNECT_DEADLINE_S", 1.0)
    lt = LoopThread()
    sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: MemoryBlockDevice(1024)})
    tgt = NvmeTcpTarget([sub], "127.0.0.1", 0, options=TargetOptions(io_workers=2))
    lt.run(tgt.start())
    try:
        idle = [open_from(a, tgt.port) for a in ATTACKERS for _ in range(40)]
        try:
            legit = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST, timeout_s=5)
            check_legit(legit, 0)
            # the connect deadline closes what never connected
            assert wait_closed(idle) == [], "idle connections outlived the connect deadline"
            check_legit(legit, 1)
            legit.close()
        finally:
            for s in idle:
                s.close()
    finally:
        lt.run(tgt.stop())
        lt.close()


# --- 11: refusal logs are rate-limited --------------------------------------------------


def test_refusal_logs_are_rate_limited() -> None:
    now = [0.0]

    class Sink:
        def __init__(self) -> None:
            self.lines: list[dict[str, Any]] = []

        def warning(self, event: str, **fields: Any) -> None:
            self.lines.append({"event": event, **fields})

    sink = Sink()
    rl = RateLimitedLog(sink, clock=lambda: now[0])
    for _ in range(1000):
        rl.warning("control_bad_frame", peer="x")
    assert len(sink.lines) == REFUSAL_LINES_PER_WINDOW_MAX
    now[0] = 1.5
    rl.warning("control_bad_frame", peer="x")
    assert sink.lines[-1]["suppressed"] == 1000 - REFUSAL_LINES_PER_WINDOW_MAX


def test_bad_frame_flood_logs_a_few_lines(engine: Engine) -> None:
    with serving(engine) as srv, capture_logs() as logs:
        assert srv.tcp_address is not None
        for _ in range(200):
            with socket.create_connection(srv.tcp_address, timeout=5) as s:
                s.sendall(b"\xff\xff\xff\xff" + b"x" * 8)  # an impossible frame length
                with contextlib.suppress(OSError):
                    s.recv(4096)
    bad = [e for e in logs if e["event"] == "control_bad_frame"]
    assert 1 <= len(bad) <= 3 * REFUSAL_LINES_PER_WINDOW_MAX  # not one line each


def test_one_controllers_queues_share_one_buffer_budget() -> None:
    """127 queues of one host cannot pin 127 x data_buffers_per_queue x max_io_size."""
    budget = BufferBudget()
    pools = [SizedPool(4 << 20, 8) for _ in range(48)]
    for p in pools:
        p.attach(budget)
    taken = [b for p in pools for _ in range(8) if (b := p.take(4 << 20)) is not None]
    assert len(taken) * (4 << 20) <= CONTROLLER_BUFFER_BYTES_MAX
    assert budget.used == len(taken) * (4 << 20)
    woken: list[int] = []
    budget.waiters.add(lambda: woken.append(1))
    pools[0].close(taken[:8])  # a queue goes: its buffers go back, and waiters hear of it
    assert budget.used == (len(taken) - 8) * (4 << 20) and woken
