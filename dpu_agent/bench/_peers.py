"""Peers of `dpuctl bench datapath`, each moving the same bytes as the agent in the same run.

- raw NIXL (`nixl_raw_gbps`): a child process WRITEs into this process's registered buffers in
  the agent's segment size and depth, no tier, no crypto, no control plane: the ceiling the
  agent's NIXL get is measured against.
- Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`, TCP, P2P handshake): the same
  shape, a child writing into this process's registered buffers.
- Redis with `streams` connections, each pipelining its share of SETs then GETs.
- the socket ceiling with `streams` sockets, each sender thread into a receiver thread.

The children print one JSON line when ready, then one line of seconds per "go" line on stdin.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "LmcachePeer",
    "MooncakePeer",
    "NixlRawPeer",
    "lmcache_python",
    "mooncake_available",
    "redis_streams_round",
    "socket_ceiling_streams",
]

PEER_START_TIMEOUT_S = 60.0  # UCX / Mooncake start-up on a loaded 2-core box
PEER_ROUND_TIMEOUT_S = 120.0  # one round moves at most CHUNKS_MAX x 32 MiB

_NIXL_INITIATOR = r"""
import json, os, sys, time
import numpy as np
from host_shim.transport import new_agent
from dpu_agent.nixl import NIXL_SEGMENT_BYTES as SEG, NIXL_STAGING_SLOTS as DEPTH
info = json.loads(sys.stdin.readline())
a = new_agent("bench-raw-initiator", progress_thread=False)
src = np.random.default_rng(3).integers(0, 255, SEG * DEPTH, dtype=np.uint8)
a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
peer = a.add_remote_agent(bytes.fromhex(info["metadata"]))
jobs = [(c * info["chunk"] + off, min(SEG, info["chunk"] - off))
        for c in range(info["count"]) for off in range(0, info["chunk"], SEG)]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    inflight = []
    for i, (off, n) in enumerate(jobs):
        if len(inflight) == DEPTH:
            h = inflight.pop(0)
            while (st := a.check_xfer_state(h)) == "PROC":
                pass
            assert st == "DONE", st
            a.release_xfer_handle(h)
        slot = (i % DEPTH) * SEG
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data + slot, n, 0)], "DRAM"),
                              a.get_xfer_descs([(info["addr"] + off, n, 0)], "DRAM"), peer)
        assert a.transfer(h) != "ERR"
        inflight.append(h)
    for h in inflight:
        while (st := a.check_xfer_state(h)) == "PROC":
            pass
        assert st == "DONE", st
        a.release_xfer_handle(h)
    print(time.perf_counter() - t0, flush=True)
os._exit(0)
"""

_MOONCAKE_INITIATOR = r"""
import json, os, sys, time
import numpy as np
from mooncake.engine import TransferEngine
SEG, DEPTH = 4 << 20, 8
info = json.loads(sys.stdin.readline())
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = np.random.default_rng(3).integers(0, 255, SEG * DEPTH, dtype=np.uint8)
assert te.register_memory(src.ctypes.data, src.nbytes) == 0
target = f"127.0.0.1:{info['port']}"
jobs = [(c * info["chunk"] + off, min(SEG, info["chunk"] - off))
        for c in range(info["count"]) for off in range(0, info["chunk"], SEG)]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    for b in range(0, len(jobs), DEPTH):
        batch = jobs[b : b + DEPTH]
        rc = te.batch_transfer_sync_write(
            target, [src.ctypes.data + i * SEG for i in range(len(batch))],
            [info["addr"] + off for off, _ in batch], [n for _, n in batch])
        assert rc == 0, rc
    print(time.perf_counter() - t0, flush=True)
os._exit(0)
"""


_LMCACHE_CLIENT = r"""
import json, os, socket, subprocess, sys, threading, time
import numpy as np, torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage
info = json.loads(sys.stdin.readline())
chunk, count, streams = info["chunk"], info["count"], info["streams"]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
argv = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while True:
    try:
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        break
    except OSError:
        assert time.monotonic() < deadline, "lm:// server did not start"
        time.sleep(0.1)
data = [np.random.default_rng(i).integers(0, 255, chunk, dtype=np.uint8) for i in range(count)]
sinks = [memoryview(bytearray(chunk)) for _ in range(count)]
shape = torch.Size((chunk, 0, 0, 0))
def key(rnd, i):
    return CacheEngineKey("bench", 1, 0, rnd * 100000 + i, torch.uint8)
def msg(cmd, k, n):
    return ClientMetaMessage(cmd, k, n, MemoryFormat(1), torch.uint8, shape).serialize()
def recv_exact(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        assert n > 0, "server closed"
        got += n
def put(sock, rnd, idx):
    for i in idx:
        sock.sendall(msg(ClientCommand.PUT, key(rnd, i), chunk)); sock.sendall(data[i].data)
    # the server answers no PUT: an EXIST round trip says every PUT before it was handled
    sock.sendall(msg(ClientCommand.EXIST, key(rnd, idx[-1]), 0))
    head = bytearray(ServerMetaMessage.packlength()); recv_exact(sock, memoryview(head))
def get(sock, rnd, idx):
    for i in idx:
        sock.sendall(msg(ClientCommand.GET, key(rnd, i), 0))
    for i in idx:
        head = bytearray(ServerMetaMessage.packlength()); recv_exact(sock, memoryview(head))
        meta = ServerMetaMessage.deserialize(bytes(head))
        assert meta.length == chunk, meta
        recv_exact(sock, sinks[i])
def timed(fn, rnd):
    parts = [list(range(j, count, streams)) for j in range(streams)]
    ts = [threading.Thread(target=fn, args=(s, rnd, p)) for s, p in zip(socks, parts) if p]
    t0 = time.perf_counter()
    for t in ts: t.start()
    for t in ts: t.join()
    return time.perf_counter() - t0
print(json.dumps({"ready": True}), flush=True)
rnd = 0
for line in sys.stdin:
    rnd += 1
    p = timed(put, rnd); g = timed(get, rnd)
    assert all(bytes(sinks[i]) == data[i].tobytes() for i in range(count)), "lm:// get not exact"
    print(p, g, flush=True)
server.kill()
os._exit(0)
"""


class _InitiatorChild:
    """A child that writes into our registered pool on each "go"; seconds per round."""

    def __init__(
        self, script: str, info: dict[str, Any], env: dict[str, str], python: str = sys.executable
    ) -> None:
        self.proc = subprocess.Popen([python, "-c", script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)  # fmt: skip
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(info) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + PEER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self._line()
            if line.startswith("{"):
                return
        raise RuntimeError("peer did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.poll()}")
        return line.strip()

    def round_s(self) -> float:
        return self.round_values()[0]

    def round_values(self) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        while True:  # libraries may log to stdout: the first line of numbers is ours
            line = self._line()
            with contextlib.suppress(ValueError):
                return [float(v) for v in line.split()]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class NixlRawPeer:
    """Two NIXL agents, no tier: a child WRITEs `count` x `chunk` bytes into `pool`."""

    def __init__(self, pool: np.ndarray, chunk: int, count: int, env: dict[str, str]) -> None:
        from host_shim.transport import new_agent

        self.pool = pool  # registered: it must outlive every transfer into it
        self.agent = new_agent("bench-raw-target", progress_thread=True)  # as the host shim
        self.agent.register_memory([(int(pool.ctypes.data), pool.nbytes, 0, "")], "DRAM")
        info = {"metadata": bytes(self.agent.get_agent_metadata()).hex(),
                "addr": int(pool.ctypes.data), "chunk": chunk, "count": count}  # fmt: skip
        self.child = _InitiatorChild(_NIXL_INITIATOR, info, env)

    def round_s(self) -> float:
        return self.child.round_s()

    def close(self) -> None:
        self.child.close()  # the agent is left to process exit (NIXL teardown, MEASURED.md)


def mooncake_available() -> bool:
    return importlib.util.find_spec("mooncake") is not None


class MooncakePeer:
    """Mooncake's transfer engine over TCP: a child writes into `pool` registered here."""

    def __init__(self, pool: np.ndarray, chunk: int, count: int, env: dict[str, str]) -> None:
        from mooncake.engine import TransferEngine

        self.pool = pool  # registered: it must outlive every transfer into it
        self.te = TransferEngine()
        if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        if self.te.register_memory(int(pool.ctypes.data), pool.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        info = {"port": int(self.te.get_rpc_port()), "addr": int(pool.ctypes.data),
                "chunk": chunk, "count": count}  # fmt: skip
        self.child = _InitiatorChild(_MOONCAKE_INITIATOR, info, env)

    def round_s(self) -> float:
        return self.child.round_s()

    def close(self) -> None:
        self.child.close()


def lmcache_python() -> tuple[str | None, str]:
    """An interpreter with LMCache: DPUKV_LMCACHE_PYTHON, else this one; (None, why) if none."""
    python = os.environ.get("DPUKV_LMCACHE_PYTHON") or sys.executable
    probe = subprocess.run([python, "-c", "import lmcache.v1.server, lmcache.v1.protocol"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        return None, (f"LMCache not importable by {python} (set DPUKV_LMCACHE_PYTHON to an "
                      "interpreter with lmcache installed)")  # fmt: skip
    return python, ""


class LmcachePeer:
    """LMCache's own `lm://` server (`python -m lmcache.v1.server`, CPU storage) and a client
    speaking its protocol (lmcache.v1.protocol) over `streams` sockets, in LMCache's interpreter:
    PUTs then GETs of `count` x `chunk` bytes, checked byte-exact. (put s, get s) per round."""

    def __init__(self, python: str, chunk: int, count: int, streams: int) -> None:
        info = {"chunk": chunk, "count": count, "streams": streams}
        self.child = _InitiatorChild(_LMCACHE_CLIENT, info, dict(os.environ), python)

    def round_s(self) -> float:
        raise AssertionError("use round_values(): (put s, get s)")

    def round_values(self) -> list[float]:
        return self.child.round_values()

    def close(self) -> None:
        self.child.close()


def _split(n: int, streams: int) -> list[range]:
    return [range(i, n, streams) for i in range(streams)]


def redis_streams_round(
    clients: list[Any], chunks: list[np.ndarray], rnd: int
) -> tuple[float, float]:
    """Seconds for SET then GET of every chunk over len(clients) connections at once, each
    pipelining its share (chunk i goes over connection i % streams)."""
    parts = _split(len(chunks), len(clients))

    def sets(r: Any, idx: range) -> None:
        p = r.pipeline(transaction=False)
        for i in idx:
            p.set(f"s{rnd}:{i}", chunks[i].reshape(-1).view(np.uint8).data)
        p.execute()

    def gets(r: Any, idx: range) -> None:
        p = r.pipeline(transaction=False)
        for i in idx:
            p.get(f"s{rnd}:{i}")
        got = p.execute()
        assert all(
            g is not None and len(g) == chunks[i].nbytes for g, i in zip(got, idx, strict=True)
        )

    set_s = _threads([(sets, (r, idx)) for r, idx in zip(clients, parts, strict=True)])
    get_s = _threads([(gets, (r, idx)) for r, idx in zip(clients, parts, strict=True)])
    clients[0].flushall()
    return set_s, get_s


def _threads(jobs: list[tuple[Any, tuple[Any, ...]]]) -> float:
    """Run each job in its own thread; seconds until the last one finished."""
    errors: list[BaseException] = []

    def run(fn: Any, args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(PEER_ROUND_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def socket_ceiling_streams(nbytes: int, streams: int, message_bytes: int = 32 << 20) -> float:
    """GB/s of `streams` blocking TCP loopback pairs at once, each moving nbytes / streams in
    `message_bytes` messages, `sendall` into `recv_into` a preallocated buffer (threads)."""
    count = max(1, nbytes // message_bytes // streams)
    payload = np.random.default_rng(1).integers(0, 255, message_bytes, dtype=np.uint8)
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        pairs = []
        for _ in range(streams):
            c = stack.enter_context(socket.create_connection(srv.getsockname()[:2]))
            conn, _ = srv.accept()
            pairs.append((c, stack.enter_context(conn)))
        sinks = [memoryview(bytearray(message_bytes)) for _ in range(streams)]

        def receive(conn: socket.socket, sink: memoryview) -> None:
            for _ in range(count):
                got = 0
                while got < message_bytes:
                    n = conn.recv_into(sink[got:])
                    assert n > 0, "sender closed early"
                    got += n

        def send(c: socket.socket) -> None:
            for _ in range(count):
                c.sendall(payload.data)

        jobs = [(receive, (conn, sink)) for (_, conn), sink in zip(pairs, sinks, strict=True)]
        seconds = _threads(jobs + [(send, (c,)) for c, _ in pairs])
    return round(count * streams * message_bytes / seconds / 1e9, 3)


@contextlib.contextmanager
def redis_clients(port: int, streams: int) -> Iterator[list[Any]]:
    import redis

    clients = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=60) for _ in range(streams)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()
