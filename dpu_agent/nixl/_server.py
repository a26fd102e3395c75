"""The agent's side of the NIXL data path: it drives every transfer (DESIGN.md, Data path).

What is registered with NIXL here: the staging buffers every chunk is decrypted into (get) or
read into before it is encrypted (put). Both tiers hold AES-XTS ciphertext (engine.tiers wraps
the DRAM tier too), so registering the tiers' own memory would hand hosts ciphertext; the
staging pool is the DRAM the NIC reads from and writes to, allocated and registered once.

get: lease the cached prefix, then per chunk and segment: decrypt into a free staging slot and
hash it into the chunk's xxh3-128 in the same pass (a worker thread, `CryptoBlockDevice.
read_hashed_into`), post a one-sided WRITE into the host's buffer; slots are reused as their
WRITEs complete, so decryption and the wire overlap. A chunk's segments feed its hash in order
(each waits for the one before it), so the workers take segments of different chunks in turn.
A chunk counts as loaded only when its checksum matched (the agent verifies, the host does no
per-byte work); the first mismatch ends the prefix and the chunk is deleted as corrupt.

put: per chunk: reserve, READ the host's buffer segment by segment into staging, hash, encrypt
and write to the tier (a worker thread), commit with the agent-computed checksum. The checksum
guards the stored bytes from here on; the bytes on the wire are guarded by the transport (RDMA
ICRC, TCP checksums), as on the NVMe/TCP path without digests.

Tenant isolation: a session's host NIXL agent must be named ``dpukv.<tenant>.*`` (checked in the
metadata before NIXL loads it), one session per name; a get or put may only target spans inside
regions its own session registered. NIXL itself also refuses addresses its remote metadata does
not cover (NIXL_ERR_NOT_FOUND): a second line, not the one relied on.

All NIXL calls run on one thread (the agent's NIXL agent is created without a progress thread,
polled by that thread): sessions are served one transfer batch at a time.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import itertools
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from dpu_agent.blockdev import BLOCK_SIZE
from dpu_agent.crypto.blockdev import CryptoBlockDevice
from dpu_agent.crypto.xts import Xxh3
from dpu_agent.engine import errors as engine_errors
from dpu_agent.log import get_logger
from host_shim.transport import NixlUnavailable, new_agent, nixl_status
from kvproto.control import NIXL_REGIONS_MAX, RemoteProtocolError

__all__ = [
    "NIXL_IO_WORKERS",
    "NIXL_SEGMENT_BYTES",
    "NIXL_STAGING_SLOTS",
    "NixlServer",
    "metadata_agent_name",
]

log = get_logger("dpu_agent.nixl")

# One WRITE/READ moves a segment: 4 MiB is where UCX-TCP and one AES-XTS call run at full speed
# here (docs/MEASURED.md), and it bounds staging per slot.
NIXL_SEGMENT_BYTES = 4 << 20
# Segments in flight: 8 x 4 MiB = 32 MiB registered once; enough to keep decryption and the
# wire both busy (more only adds memory).
NIXL_STAGING_SLOTS = 8
# The first segment of each of a get's first chunks (one per I/O thread): the first WRITE leaves
# after decrypting this much rather than a whole segment (0.7-2 ms of a 60 ms get here).
NIXL_FIRST_SEGMENT_BYTES = 1 << 20
NIXL_IO_WORKERS = 2  # decrypt/encrypt threads (AES-XTS releases the GIL); the DPU's spare cores
NIXL_XFER_TIMEOUT_S = 30.0  # a transfer not done by then: the host is gone
SESSIONS_MAX = 4096  # NIXL sessions (bounded by the control server's connections_max anyway)
# Regions one session may hold: the host keeps at most NIXL_REGIONS_MAX registered and drops
# before it adds; twice that leaves room for one call's additions before its drops land.
SESSION_REGIONS_MAX = 2 * NIXL_REGIONS_MAX

_MD_PREFIX = b"nixlSerDes|Agent"
_MD_LEN = struct.Struct("<Q")
NAME_BYTES_MAX = 256


def metadata_agent_name(metadata: bytes) -> str:
    """The agent name inside NIXL metadata (nixlSerDes: tag, u64 LE length, name), read
    before NIXL loads it, so a session cannot take over another session's name."""
    n = len(_MD_PREFIX)
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < n + _MD_LEN.size:
        raise RemoteProtocolError("nixl metadata: not NIXL agent metadata (nixlSerDes|Agent)")
    (length,) = _MD_LEN.unpack_from(metadata, n)
    if not 0 < length <= NAME_BYTES_MAX or len(metadata) < n + _MD_LEN.size + length:
        raise RemoteProtocolError(f"nixl metadata: agent name of {length} bytes")
    raw = metadata[n + _MD_LEN.size : n + _MD_LEN.size + length]
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise RemoteProtocolError("nixl metadata: agent name is not ASCII") from None


_Span = tuple[int, int, int, str]  # addr, nbytes, dev, mem


@dataclass(slots=True, kw_only=True)
class _Session:
    tenant: str
    remote: str
    # registered regions, sorted by address: starts (for bisect) and (end, dev, mem)
    starts: list[int] = field(default_factory=list)
    rest: list[tuple[int, int, str]] = field(default_factory=list)

    def add(self, addr: int, nbytes: int, dev: int, mem: str) -> None:
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and self.starts[i] == addr:
            self.rest[i] = (addr + nbytes, dev, mem)
            return
        self.starts.insert(i, addr)
        self.rest.insert(i, (addr + nbytes, dev, mem))

    def drop(self, addr: int) -> None:
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and self.starts[i] == addr:
            del self.starts[i], self.rest[i]

    def find(self, addr: int, nbytes: int) -> tuple[int, str] | None:
        """(dev, mem) of the registered region holding [addr, addr+nbytes), else None."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        end, dev, mem = self.rest[i]
        return (dev, mem) if addr + nbytes <= end else None


class NixlServer:
    """The NIXL agent of one dpu_agent and the sessions of hosts using it."""

    def __init__(self, engine: Callable[[], Any], name: str) -> None:
        self._engine = engine  # the agent's engine (it starts after this object)
        self.name = name
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self._io = cf.ThreadPoolExecutor(NIXL_IO_WORKERS, thread_name_prefix="nixl-io")
        self._agent: Any = None
        self._staging: np.ndarray | None = None
        self._sessions: dict[int, _Session] = {}
        self._names: dict[str, int] = {}  # host NIXL agent name -> session id

    def status(self) -> dict[str, Any]:
        """What hello says: whether hosts may use NIXL with this agent, and why not."""
        return nixl_status()

    async def handle(
        self, session_id: int, tenant: str, op: str, fields: Mapping[str, Any]
    ) -> dict[str, Any]:
        import asyncio

        loop = asyncio.get_running_loop()
        call = getattr(self, "_" + op)
        return await loop.run_in_executor(self._thread, call, session_id, tenant, fields)

    def session_closed(self, session_id: int) -> None:
        if session_id in self._sessions:
            self._thread.submit(self._forget, session_id)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)

    # --- on the NIXL thread -----------------------------------------------------------------
    def _start(self) -> Any:
        if self._agent is None:
            try:  # no progress thread: this thread polls while it drives transfers
                agent = new_agent(self.name, progress_thread=False)
            except NixlUnavailable as e:
                raise RemoteProtocolError(f"this agent has no NIXL data path: {e}") from None
            staging = np.zeros(NIXL_STAGING_SLOTS * NIXL_SEGMENT_BYTES, np.uint8)
            agent.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")
            self._agent, self._staging = agent, staging
            log.info("nixl_started", name=self.name, staging_bytes=staging.nbytes)
        return self._agent

    def _forget(self, session_id: int) -> None:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return
        self._names.pop(s.remote, None)
        try:
            self._agent.remove_remote_agent(s.remote)
        except Exception as e:  # already gone: nothing to undo
            log.info("nixl_remove_remote_failed", remote=s.remote, error=str(e))

    def _session(self, session_id: int) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise RemoteProtocolError("no NIXL session: send nixl_connect first")
        return s

    def _load(self, session_id: int, tenant: str, metadata: bytes) -> str:
        name = metadata_agent_name(metadata)
        if not name.startswith(f"dpukv.{tenant}."):
            raise RemoteProtocolError(
                f"nixl metadata: host agent {name!r} must be named dpukv.{tenant}.<anything> "
                "(host_shim names it so)", "forbidden"
            )  # fmt: skip
        owner = self._names.get(name)
        if owner is not None and owner != session_id:
            raise RemoteProtocolError(
                f"nixl: host agent {name!r} belongs to another session", "forbidden"
            )
        loaded = self._start().add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        assert loaded == name, (loaded, name)
        return name

    def _nixl_connect(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        old = self._sessions.get(sid)
        if old is None and len(self._sessions) >= SESSIONS_MAX:
            raise engine_errors.LimitExceeded(f"{SESSIONS_MAX} NIXL sessions; retry later")
        name = self._load(sid, tenant, f["metadata"])
        if old is not None and old.remote != name:
            self._forget(sid)
        if sid not in self._sessions:
            self._sessions[sid] = _Session(tenant=tenant, remote=name)
        self._names[name] = sid
        log.info("nixl_session", tenant=tenant, host_agent=name, session=sid)
        return {"agent": self.name, "metadata": bytes(self._agent.get_agent_metadata())}

    def _nixl_register(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        if self._load(sid, tenant, f["metadata"]) != s.remote:
            raise RemoteProtocolError("nixl_register: metadata of another host agent", "forbidden")
        for addr, _nbytes, _dev, _mem in f["drop"]:
            s.drop(addr)
        if len(s.starts) + len(f["add"]) > SESSION_REGIONS_MAX:
            raise engine_errors.LimitExceeded(
                f"session holds {len(s.starts)} NIXL regions (max {SESSION_REGIONS_MAX}); "
                "drop some (nixl_register drop) before adding more"
            )
        for addr, nbytes, dev, mem in f["add"]:
            s.add(addr, nbytes, dev, mem)
        return {"regions": len(s.starts)}

    def _spans(self, s: _Session, spans: list[list[int]], what: str) -> list[_Span]:
        out = []
        for i, (addr, nbytes) in enumerate(spans):
            where = s.find(addr, nbytes)
            if where is None:
                raise RemoteProtocolError(
                    f"{what}[{i}] = [{addr:#x}, {nbytes}] is not inside a region this session "
                    "registered (nixl_register)", "forbidden"
                )  # fmt: skip
            out.append((addr, nbytes, *where))
        return out

    # --- get: decrypt into staging, verify, WRITE into the host --------------------------------
    def _nixl_get(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        targets = self._spans(s, f["targets"], "targets")
        keys = f["keys"][: len(targets)]
        if not keys:
            return {"loaded": 0, "hits": 0}
        engine = self._engine()
        hits, lease_id, _ = engine.lookup_lists(tenant, keys, lease=True)
        try:
            loaded, corrupt = _Mover(self, s, tenant).get(hits, targets)
        finally:
            if lease_id:
                engine.release(tenant, lease_id)
        if corrupt is not None:  # never served again; counted as an integrity failure
            log.warning("nixl_integrity_failure", tenant=tenant, key=corrupt.hex())
            engine.delete(tenant, corrupt)
        return {"loaded": loaded, "hits": len(hits)}

    # --- put: READ from the host into staging, hash, encrypt to the tier, commit ---------------
    def _nixl_put(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        sources = self._spans(s, f["sources"], "sources")
        keys, parents = f["keys"], f["parents"]
        if len(parents) != len(keys) or len(sources) != len(keys):
            raise RemoteProtocolError(
                f"nixl_put: {len(keys)} keys, {len(sources)} sources, {len(parents)} parents: "
                "give one of each per chunk"
            )
        if not keys:
            return {"stored": 0}
        return {"stored": _Mover(self, s, tenant).put(keys, parents, sources)}


class _Mover:
    """One batch of segments through the staging slots; every call runs on the NIXL thread."""

    def __init__(self, server: NixlServer, session: _Session, tenant: str) -> None:
        assert server._agent is not None and server._staging is not None
        self.agent = server._agent
        self.base = int(server._staging.ctypes.data)
        self.view = memoryview(server._staging.data)
        self.io = server._io
        self.remote = session.remote
        self.tenant = tenant
        self.engine = server._engine()
        self.devs = self.engine.namespaces(tenant)
        self.free: deque[int] = deque(range(NIXL_STAGING_SLOTS))
        self.deadline = time.monotonic() + NIXL_XFER_TIMEOUT_S

    def slot(self, i: int, nbytes: int) -> memoryview:
        return self.view[i * NIXL_SEGMENT_BYTES : i * NIXL_SEGMENT_BYTES + nbytes]

    def post(self, op: str, slot: int, span: _Span, off: int, n: int) -> Any:
        local = self.agent.get_xfer_descs([(self.base + slot * NIXL_SEGMENT_BYTES, n, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(span[0] + off, n, span[2])], span[3])
        h = self.agent.initialize_xfer(op, local, remote, self.remote)
        if self.agent.transfer(h) == "ERR":
            log.warning("nixl_post_failed", op=op, remote=self.remote, nbytes=n)
            self.agent.release_xfer_handle(h)
            return None
        return h

    def state(self, h: Any) -> str:
        """DONE, PROC or ERR (a transfer past the deadline is ERR: the host is gone)."""
        if h is None:
            return "ERR"
        st = str(self.agent.check_xfer_state(h))
        if st == "PROC" and time.monotonic() > self.deadline:
            st = "ERR"
        if st == "ERR":
            log.warning("nixl_transfer_failed", remote=self.remote)
        if st != "PROC":
            self.agent.release_xfer_handle(h)
            self.deadline = time.monotonic() + NIXL_XFER_TIMEOUT_S  # progress: a new deadline
        return st

    @staticmethod
    def segments(length: int, start: int = 0) -> list[tuple[int, int]]:
        return [(off, min(NIXL_SEGMENT_BYTES, length - off))
                for off in range(start, length, NIXL_SEGMENT_BYTES)]  # fmt: skip

    @staticmethod
    def ramped(length: int) -> list[tuple[int, int]]:
        """segments(), the first one NIXL_FIRST_SEGMENT_BYTES: the wire starts sooner."""
        if length <= NIXL_FIRST_SEGMENT_BYTES:
            return [(0, length)]
        return [(0, NIXL_FIRST_SEGMENT_BYTES), *_Mover.segments(length, NIXL_FIRST_SEGMENT_BYTES)]

    @staticmethod
    def interleaved(lengths: list[int], lanes: int) -> deque[tuple[int, int, int]]:
        """(chunk, offset, bytes) of every segment, `lanes` chunks side by side (one segment of
        each in turn), each chunk's in order: the I/O threads then decrypt different chunks at
        once, where segments of one chunk would wait for each other (its hash is fed in order)."""
        jobs: deque[tuple[int, int, int]] = deque()
        for first in range(0, len(lengths), lanes):
            rows = itertools.zip_longest(*(
                [(ci, off, n) for off, n in (_Mover.ramped if first == 0 else _Mover.segments)(
                    lengths[ci])]
                for ci in range(first, min(first + lanes, len(lengths)))
            ))  # fmt: skip
            jobs.extend(job for row in rows for job in row if job is not None)
        return jobs

    def read_tier(
        self, nsid: int, lba: int, slot: int, n: int, hasher: Xxh3, prev: cf.Future[None] | None
    ) -> None:
        """Decrypt a segment into `slot` and feed its `n` bytes of plaintext to its chunk's
        `hasher`, once the chunk's previous segment `prev` has fed its own."""
        if prev is not None:  # submitted earlier to the same FIFO pool: running or done
            prev.result(timeout=NIXL_XFER_TIMEOUT_S)  # raises if it failed: the chunk is lost
        nblk = -(-n // BLOCK_SIZE)
        view, dev = self.slot(slot, nblk * BLOCK_SIZE), self.devs[nsid]
        if isinstance(dev, CryptoBlockDevice):
            dev.read_hashed_into(lba, view, hasher, n)
        else:  # a tier decrypted below us (SPDK's crypto vbdev): hash after the read
            dev.read_into(lba, view)
            hasher.update(view[:n])

    def write_tier(self, nsid: int, lba: int, slot: int, n: int) -> None:
        nblk = -(-n // BLOCK_SIZE)
        view = self.slot(slot, nblk * BLOCK_SIZE)
        view[n:] = bytes(len(view) - n)  # the tail block's padding
        self.devs[nsid].write(lba, view)

    def get(self, hits: list[list[Any]], targets: list[_Span]) -> tuple[int, bytes | None]:
        """(leading chunks written and verified, key of a chunk that failed verification)."""
        usable = 0
        while usable < len(hits) and int(hits[usable][4]) == targets[usable][1]:
            usable += 1
        lengths = [int(hits[ci][4]) for ci in range(usable)]
        jobs = self.interleaved(lengths, NIXL_IO_WORKERS)
        hashers = [Xxh3(hits[ci][0]) for ci in range(usable)]
        last: list[cf.Future[None] | None] = [None] * usable  # each chunk's latest segment
        reads: deque[tuple[cf.Future[None], int, int, int, int]] = deque()
        writes: deque[tuple[int, Any, int]] = deque()  # slot, handle, chunk
        failed = usable  # the first chunk that failed (transfer or checksum)
        corrupt = None
        while True:
            while self.free and jobs:
                ci, off, n = jobs.popleft()
                if ci >= failed:
                    continue
                slot, hit = self.free.popleft(), hits[ci]
                last[ci] = fut = self.io.submit(
                    self.read_tier, int(hit[1]), int(hit[2]) + off // BLOCK_SIZE, slot, n,
                    hashers[ci], last[ci],
                )  # fmt: skip
                reads.append((fut, slot, ci, off, n))
            failed = self.reap(writes, failed, block=False)
            if reads:
                fut, slot, ci, off, n = reads[0]
                if not fut.done():  # keep UCX moving while the tier read decrypts
                    if writes:
                        failed = self.reap(writes, failed, block=False)
                    else:
                        cf.wait([fut])
                    continue
                reads.popleft()
                if fut.exception() is not None:
                    log.warning("nixl_tier_read_failed", error=repr(fut.exception()))
                if fut.exception() is not None or ci >= failed:
                    self.free.append(slot)
                    failed = min(failed, ci)
                    continue
                if off + n == lengths[ci] and hashers[ci].digest() != hits[ci][5]:
                    corrupt, failed = hits[ci][0], min(failed, ci)
                    self.free.append(slot)
                    continue
                writes.append((slot, self.post("WRITE", slot, targets[ci], off, n), ci))
            elif writes:
                failed = self.reap(writes, failed, block=True)
            elif not jobs:  # else slots just came free: go on
                return failed, corrupt

    def reap(self, writes: deque[tuple[int, Any, int]], failed: int, *, block: bool) -> int:
        """Retire completed transfers (the oldest first); with `block`, at least one."""
        while writes:
            slot, h, ci = writes[0]
            st = self.state(h)
            if st == "PROC":
                if block:
                    continue
                return failed
            writes.popleft()
            self.free.append(slot)
            if st != "DONE":
                failed = min(failed, ci)
            block = False
        return failed

    def put(self, keys: list[bytes], parents: list[bytes | None], sources: list[_Span]) -> int:
        """Reserve, READ, hash, encrypt to the tier and commit each chunk; leading stored."""
        jobs = deque((ci, off, n) for ci in range(len(keys))
                     for off, n in self.segments(sources[ci][1]))  # fmt: skip
        res: list[Any] = []  # reservations, in chunk order
        hashers = [xxhash.xxh3_128(k) for k in keys]
        reads: deque[tuple[int, Any, int, int, int]] = deque()  # slot, handle, chunk, off, n
        writes: deque[tuple[cf.Future[None], int, int]] = deque()  # future, slot, chunk
        failed = len(keys)
        while True:
            while self.free and jobs and jobs[0][0] < failed:
                ci, off, n = jobs.popleft()
                if off == 0 and not self.reserve(res, keys[ci], sources[ci][1], parents[ci]):
                    failed = ci
                    break
                slot = self.free.popleft()
                reads.append((slot, self.post("READ", slot, sources[ci], off, n), ci, off, n))
            while writes and writes[0][0].done():
                fut, slot, ci = writes.popleft()
                self.free.append(slot)
                if fut.exception() is not None:
                    log.warning("nixl_put_write_failed", error=str(fut.exception()))
                    failed = min(failed, ci)
            if reads:
                slot, h, ci, off, n = reads[0]
                st = self.state(h)
                if st == "PROC":
                    if writes and not self.free:
                        cf.wait([writes[0][0]], timeout=0.0002)
                    continue
                reads.popleft()
                if st != "DONE" or ci >= failed:
                    self.free.append(slot)
                    failed = min(failed, ci)
                    continue
                hashers[ci].update(self.slot(slot, n))
                nsid, lba = int(res[ci].nsid), int(res[ci].lba) + off // BLOCK_SIZE
                writes.append((self.io.submit(self.write_tier, nsid, lba, slot, n), slot, ci))
            elif writes:
                cf.wait([writes[0][0]])
            elif not (jobs and jobs[0][0] < failed):  # else slots just came free: go on
                return self.commit(res, hashers, min(failed, len(res)))

    def reserve(self, res: list[Any], key: bytes, length: int, parent: bytes | None) -> bool:
        try:
            res.append(self.engine.reserve(self.tenant, key, length, parent=parent))
        except engine_errors.EngineError as e:  # full, over quota: the prefix ends here
            log.info("nixl_put_reserve_refused", tenant=self.tenant, error=str(e))
            return False
        return True

    def commit(self, res: list[Any], hashers: list[Any], stored: int) -> int:
        """Commit the leading chunks that arrived whole; give the other reservations back."""
        for ci, r in enumerate(res):
            if ci < stored:
                try:
                    self.engine.commit(self.tenant, r.reservation_id, hashers[ci].digest())
                    continue
                except engine_errors.EngineError as e:
                    log.info("nixl_put_commit_refused", tenant=self.tenant, error=str(e))
                    stored = ci
            try:
                self.engine.abort(self.tenant, r.reservation_id)
            except engine_errors.EngineError:
                pass  # expired already: nothing to give back
        return stored
