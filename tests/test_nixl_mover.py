"""The agent's NIXL transfer loop (dpu_agent.nixl._Mover) against a real engine, with NIXL
replaced by a loopback that moves bytes with memmove: deterministic completion orders that the
UCX runs in test_nixl_path.py hit only by chance. The real NIXL runs in test_nixl_path.py."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import itertools
import mmap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpu_agent.crypto import CryptoBlockDevice
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.nixl import NIXL_LANES, NIXL_SEGMENT_BYTES, NIXL_STAGING_SLOTS, NixlServer
from dpu_agent.nixl._server import NIXL_FIRST_SEGMENT_BYTES, _Mover, _Session

TENANT = "acme"
CHUNK = 2 * NIXL_SEGMENT_BYTES + 1000  # three segments, the last one not whole blocks
COUNT = 6  # 18 segments: more than the staging slots, so slots are reused


class _Xfer:
    def __init__(self, op: str, local: tuple[int, int, int], remote: tuple[int, int, int]) -> None:
        self.op, self.local, self.remote = op, local, remote
        self.polls = 0


class LoopbackAgent:
    """What _Mover calls on a nixl_agent, moving bytes inside this process. `polls` checks
    before a transfer completes; `fail_at`: the n-th transfer posted ends in ERR."""

    def __init__(self, polls: int = 0, fail_at: int | None = None) -> None:
        self.polls, self.fail_at, self.posted = polls, fail_at, 0

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem: str) -> list[Any]:
        return list(descs)

    def initialize_xfer(self, op: str, local: list[Any], remote: list[Any], peer: str) -> _Xfer:
        return _Xfer(op, local[0], remote[0])

    def transfer(self, h: _Xfer) -> str:
        self.posted += 1
        h.polls = -1 if self.posted == self.fail_at else self.polls
        return "PROC"

    def check_xfer_state(self, h: _Xfer) -> str:
        if h.polls < 0:
            return "ERR"
        if h.polls:
            h.polls -= 1
            return "PROC"
        (laddr, n, _), (raddr, _, _) = h.local, h.remote
        src, dst = (laddr, raddr) if h.op == "WRITE" else (raddr, laddr)
        ctypes.memmove(dst, src, n)
        return "DONE"

    def release_xfer_handle(self, h: _Xfer) -> None:
        pass


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[Engine]:
    size = 4 * COUNT * NIXL_SEGMENT_BYTES * 3
    cfg = EngineConfig(data_dir=tmp_path, dram_bytes=size, nvme_bytes=size,
                       tenants={TENANT: 0})  # fmt: skip
    e = Engine(cfg)
    yield e
    e.close()


class LoopbackLink:
    """The worker process's side of a transfer (dpu_agent.nixl._worker) around a
    LoopbackAgent, polled by a thread here: futures resolve as the worker's replies do."""

    alive = True

    def __init__(self, agent: LoopbackAgent, base: int) -> None:
        self.agent, self.base = agent, base
        self.lock = threading.Lock()
        self.inflight: list[tuple[cf.Future[Any], _Xfer]] = []
        self.stop = False
        threading.Thread(target=self._poll, daemon=True).start()

    def call(self, kind: str, op: str, off: int, n: int, addr: int, dev: int, mem: str,
             remote: str) -> cf.Future[Any]:  # fmt: skip
        fut: cf.Future[Any] = cf.Future()
        h = self.agent.initialize_xfer(op, [(self.base + off, n, 0)], [(addr, n, dev)], remote)
        self.agent.transfer(h)
        with self.lock:
            self.inflight.append((fut, h))
        return fut

    def drop(self, remote: str) -> None:
        pass

    def _poll(self) -> None:
        while not self.stop:
            with self.lock:
                for fut, h in list(self.inflight):
                    st = self.agent.check_xfer_state(h)
                    if st != "PROC":
                        self.inflight.remove((fut, h))
                        fut.set_result(st)
            time.sleep(0.0005)


def _server(engine: Engine, agent: LoopbackAgent) -> NixlServer:
    server = NixlServer(lambda: engine, "test-agent")
    _use(server, agent)
    return server


def _use(server: NixlServer, agent: LoopbackAgent) -> None:
    if server._shm is None:
        mem = mmap.mmap(-1, NIXL_LANES * NIXL_STAGING_SLOTS * NIXL_SEGMENT_BYTES)
        server._shm = (-1, mem, np.frombuffer(mem, np.uint8))
    old = server._link
    if old is not None:
        old.stop = True  # type: ignore[attr-defined]
    server._link = LoopbackLink(agent, int(server._shm[2].ctypes.data))  # type: ignore[assignment]


def _session(bufs: list[np.ndarray]) -> tuple[_Session, list[tuple[int, int, int, str]]]:
    s = _Session(sid=1, tenant=TENANT, remote="dpukv.acme.1", peer="", metadata=b"")
    spans = []
    for b in bufs:
        s.add(int(b.ctypes.data), b.nbytes, 0, "DRAM")
        spans.append((int(b.ctypes.data), b.nbytes, 0, "DRAM"))
    return s, spans


KEYS = [(i + 1).to_bytes(16, "big") for i in range(COUNT)]


@pytest.mark.parametrize("polls", [0, 3])
def test_nixl_batch_longer_than_staging_slots_is_whole(engine: Engine, polls: int) -> None:
    """Transfers that complete at once free every slot in one go: the loop must go on with the
    segments left (it stopped there once and reported chunks it never stored)."""
    server = _server(engine, LoopbackAgent(polls=polls))
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in KEYS]
    s, spans = _session(src)
    stored = _Mover(server, s, TENANT).put(KEYS, [None, *KEYS[:-1]], spans)
    assert stored == COUNT
    assert len(engine.lookup(TENANT, KEYS, lease=False).hits) == COUNT
    dst = [np.zeros(CHUNK, np.uint8) for _ in KEYS]
    s2, targets = _session(dst)
    hits, lease_id, _ = engine.lookup_lists(TENANT, KEYS)
    loaded, corrupt = _Mover(server, s2, TENANT).get(hits, targets)
    engine.release(TENANT, lease_id)
    assert (loaded, corrupt) == (COUNT, None)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))


def test_nixl_failed_transfer_ends_the_prefix(engine: Engine) -> None:
    server = _server(engine, LoopbackAgent())
    src = [np.full(CHUNK, i, np.uint8) for i in range(COUNT)]
    s, spans = _session(src)
    assert _Mover(server, s, TENANT).put(KEYS, [None] * COUNT, spans) == COUNT
    # the 4th WRITE posted: chunk 1's second segment (chunks 0 and 1 go side by side: 0, 1, 0, 1)
    _use(server, LoopbackAgent(fail_at=4))
    dst = [np.zeros(CHUNK, np.uint8) for _ in KEYS]
    s2, targets = _session(dst)
    hits, lease_id, _ = engine.lookup_lists(TENANT, KEYS)
    loaded, corrupt = _Mover(server, s2, TENANT).get(hits, targets)
    engine.release(TENANT, lease_id)
    assert (loaded, corrupt) == (1, None)
    _use(server, LoopbackAgent(fail_at=2))  # a put whose chunk 0 fails stores nothing
    assert _Mover(server, s, TENANT).put([b"z" * 16], [None], spans[:1]) == 0
    assert engine.lookup(TENANT, [b"z" * 16], lease=False).hits == []


def test_nixl_get_of_a_corrupted_chunk_is_a_miss(engine: Engine) -> None:
    server = _server(engine, LoopbackAgent())
    src = [np.full(CHUNK, 7 + i, np.uint8) for i in range(2)]
    s, spans = _session(src)
    assert _Mover(server, s, TENANT).put(KEYS[:2], [None, KEYS[0]], spans) == 2
    hits = engine.lookup(TENANT, KEYS[:2], lease=False).hits
    raw = engine.namespaces(TENANT)[hits[1].nsid]
    raw.write(hits[1].lba, memoryview(bytes(4096)))  # chunk 1's first block overwritten
    dst = [np.zeros(CHUNK, np.uint8) for _ in range(2)]
    s2, targets = _session(dst)
    h, lease_id, _ = engine.lookup_lists(TENANT, KEYS[:2])
    loaded, corrupt = _Mover(server, s2, TENANT).get(h, targets)
    engine.release(TENANT, lease_id)
    assert (loaded, corrupt) == (1, KEYS[1])
    assert np.array_equal(dst[0], src[0])


def test_nixl_interleaved_keeps_each_chunks_segments_in_order() -> None:
    seg, first = NIXL_SEGMENT_BYTES, NIXL_FIRST_SEGMENT_BYTES
    jobs = list(_Mover.interleaved([3 * seg, seg + 5, 2 * seg, seg], 2))
    # chunks 0 and 1 side by side, their first segments short (the wire starts sooner); then
    # chunks 2 and 3 in whole segments
    assert [(ci, off) for ci, off, _ in jobs] == [
        (0, 0), (1, 0), (0, first), (1, first), (0, first + seg), (0, first + 2 * seg),
        (2, 0), (3, 0), (2, seg),
    ]  # fmt: skip
    assert [n for ci, _, n in jobs if ci == 1] == [first, seg + 5 - first]
    for ci, length in enumerate([3 * seg, seg + 5, 2 * seg, seg]):
        mine = [(off, n) for c, off, n in jobs if c == ci]
        assert all(n <= seg for _, n in mine)  # each fits a staging slot
        assert [off for off, _ in mine] == sorted(off for off, _ in mine)
        assert sum(n for _, n in mine) == length and mine[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(mine))


def test_nixl_get_of_uneven_chunks_hashes_each_in_order(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long chunk beside short ones: both I/O threads then take segments of the same chunk,
    and each must feed the chunk's hash after the segment before it (else the long chunk's
    digest mismatches and the get stops before it). The long chunk's first segment is made
    slow, so its second one would otherwise be hashed first."""
    server = _server(engine, LoopbackAgent(polls=1))
    rng = np.random.default_rng(5)
    sizes = [NIXL_SEGMENT_BYTES // 2, 7 * NIXL_SEGMENT_BYTES + 4096, 4096 + 17]
    keys = [b"u%d" % i * 8 for i in range(len(sizes))]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    s, spans = _session(src)
    assert _Mover(server, s, TENANT).put(keys, [None, *keys[:-1]], spans) == len(keys)
    hits, lease_id, _ = engine.lookup_lists(TENANT, keys)
    slow_lba = int(hits[1][2])
    engine.release(TENANT, lease_id)
    read = CryptoBlockDevice.read_hashed_into

    def slow_first_segment(dev: CryptoBlockDevice, lba: int, *args: Any) -> None:
        if lba == slow_lba:
            time.sleep(0.2)
        read(dev, lba, *args)

    monkeypatch.setattr(CryptoBlockDevice, "read_hashed_into", slow_first_segment)
    dst = [np.zeros(n, np.uint8) for n in sizes]
    s2, targets = _session(dst)
    hits, lease_id, _ = engine.lookup_lists(TENANT, keys)
    loaded, corrupt = _Mover(server, s2, TENANT).get(hits, targets)
    engine.release(TENANT, lease_id)
    assert (loaded, corrupt) == (len(keys), None)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))


def test_nixl_threads_are_named_in_the_kernel() -> None:
    """The lane and decrypting threads carry their names where top -H and the bench read them
    (/proc/PID/task/TID/comm): the bench splits the agent's CPU by them."""

    def comm() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    server = NixlServer(lambda: None, "test-agent")
    try:
        assert server._thread.submit(comm).result(10) == "nixl-lane"
        assert server._io.submit(comm).result(10) == "nixl-io"
    finally:
        server.close()
