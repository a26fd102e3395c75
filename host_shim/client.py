"""KVClient: the host shim's client of the context-memory tier, and the control channel under it.

The control plane (kvproto.control frames over TCP or a Unix socket) finds chunks, leases them,
reserves room and commits; the bytes move over NVMe/TCP (host_shim.nvme) straight between the
agent's namespaces and the caller's buffers, several I/O queues at once. Every chunk read is
checked against the checksum its writer committed (kvproto.checksum): a mismatch ends the
prefix, it never hands back wrong KV. A lost agent is a miss, logged once, never an exception in
the inference loop; the next call reconnects.

    client = KVClient("tcp://127.0.0.1:7400", "default", token, layout, salt)
    n = client.get(tokens, [np.empty(layout.chunk_shape, np.float16) for _ in range(8)])

The control channel (host_shim.control) is also what `dpuctl` uses for admin commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from host_shim.control import (
    PIPELINE_BYTES_MAX,
    PIPELINE_DEPTH_MAX,
    AgentUnreachable,
    ControlChannel,
    ControlError,
    new_hostnqn,
    parse_control_url,
)
from host_shim.nvme import NvmeError, NvmeStatusError, NvmeTcpController
from host_shim.transport import TransportSelector
from kvproto.checksum import chunk_checksum, verify_checksum
from kvproto.control import (
    LOOKUP_KEYS_MAX,
)
from kvproto.keys import KEY_BYTES, ChunkLayout, chunk_keys

__all__ = [
    "PIPELINE_BYTES_MAX",
    "PIPELINE_DEPTH_MAX",
    "AgentUnreachable",
    "ControlChannel",
    "ControlError",
    "KVClient",
    "byte_view",
    "new_hostnqn",
    "parse_control_url",
]

BLOCK_BYTES = 4096  # the namespaces' logical block size

# --- KVClient -------------------------------------------------------------------------------

log = logging.getLogger("host_shim.client")

# Bytes one data-path I/O moves: a 32 MiB chunk is split into this many-byte segments spread
# over the I/O queues, so decryption on the agent and the socket copies overlap.
SEGMENT_BYTES = 4 << 20
IO_QUEUES_MAX = 32  # one connection (and one agent thread) each; beyond this the DPU saturates
CHUNKS_PER_CALL_MAX = LOOKUP_KEYS_MAX  # one lookup request takes this many keys
# After a failed connect, calls return misses at once for this long instead of each waiting
# for a connect timeout: the inference loop never stalls on a dead agent.
RECONNECT_BACKOFF_S = 0.5
# What a lost agent or a broken data path raises: a miss for the caller, never an exception.
_LOST = (AgentUnreachable, OSError, NvmeError)


def byte_view(buf: Any, nbytes: int, *, writable: bool) -> memoryview:
    """A flat, C-contiguous uint8 view of `buf` (numpy, bytearray, memoryview, torch CPU tensor).

    Objects without the buffer protocol (torch tensors) go through `.numpy()`, or a uint8
    `.view()` for dtypes numpy lacks (bfloat16); torch itself is never imported here.
    """
    obj = buf
    if not isinstance(obj, np.ndarray | bytes | bytearray | memoryview) and hasattr(obj, "numpy"):
        if getattr(obj, "device", None) is not None and str(obj.device) != "cpu":
            raise ValueError(f"buffer on {obj.device}: give a CPU tensor (GPU memory needs gpu.py)")
        try:
            obj = obj.numpy()
        except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy dtype
            torch = sys.modules["torch"]
            obj = obj.view(torch.uint8).numpy()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"buffer of shape {obj.shape} is not C-contiguous")
        view = obj.reshape(-1).view(np.uint8).data
    else:
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("buffer is not C-contiguous")
        view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
    if writable and view.readonly:
        raise ValueError(f"buffer of type {type(buf).__name__} is read-only; get() writes into it")
    if view.nbytes != nbytes:
        raise ValueError(f"buffer holds {view.nbytes} bytes; a chunk of this layout is {nbytes}")
    return view


class KVClient:
    """The inference side of the tier: lookup, get, put and prefetch of KV chunks.

    `control` is ``tcp://host:port`` or ``unix:///path``; the NVMe/TCP address and subsystem
    come from the agent's hello. Calls are thread-safe. When the agent is lost, calls return
    0 (misses) and log once; the next call reconnects.

    Several comma-separated seeds (``tcp://seed1:7400,seed2:7400``) give a cluster client
    (host_shim.cluster.ClusterKVClient) that routes each key to its owners.
    """

    def __new__(cls, control: str, *args: Any, **kwargs: Any) -> KVClient:
        if cls is KVClient and "," in control:
            from host_shim.cluster import ClusterKVClient  # imports this module: no cycle at top

            return super().__new__(ClusterKVClient)
        return super().__new__(cls)

    def __init__(
        self,
        control: str,
        tenant: str,
        token: str,
        layout: ChunkLayout,
        salt: bytes,
        *,
        io_queues: int = 4,
        timeout_s: float = 5.0,
        hostnqn: str | None = None,
        transport: str = "nvme-tcp",
    ) -> None:
        assert 1 <= io_queues <= IO_QUEUES_MAX, io_queues
        # "nixl": the agent moves chunks into/out of registered buffers (host_shim.transport);
        # "auto": NIXL when both sides have it, NVMe/TCP otherwise; the log says which
        self._xport = TransportSelector(transport, tenant)
        self.layout = layout
        self._salt = bytes(salt)
        self._channel = ControlChannel(control, tenant, token, hostnqn=hostnqn, timeout_s=timeout_s)
        self._io_queues = io_queues
        self._timeout_s = timeout_s
        self._nvme: NvmeTcpController | None = None
        self._pool = ThreadPoolExecutor(max_workers=io_queues, thread_name_prefix="kvclient-io")
        self._lock = threading.RLock()
        self._lost_logged = False
        self._retry_at = 0.0  # monotonic time before which a lost agent is not retried
        self._closed = False
        chunk_keys(
            np.zeros(0, dtype=np.uint32),
            salt=self._salt,
            layout_id=layout.layout_id,
            chunk_tokens=layout.chunk_tokens,
        )  # validates the salt now, not mid-inference

    def __repr__(self) -> str:
        return f"KVClient({self._channel.url!r}, tenant={self._channel.tenant!r})"

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- keys and connection ----------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """One 16-byte key per full chunk of `tokens` (at most CHUNKS_PER_CALL_MAX chunks)."""
        n = self.layout.chunk_tokens
        if len(tokens) // n > CHUNKS_PER_CALL_MAX:
            raise ValueError(
                f"{len(tokens)} tokens make {len(tokens) // n} chunks of {n}; one call takes at "
                f"most {CHUNKS_PER_CALL_MAX} ({CHUNKS_PER_CALL_MAX * n} tokens): split the call"
            )
        return chunk_keys(tokens, salt=self._salt, layout_id=self.layout.layout_id, chunk_tokens=n)

    def _ensure(self) -> NvmeTcpController:
        assert not self._closed, "KVClient used after close()"
        if self._nvme is not None and self._channel.connected:
            return self._nvme
        wait_s = self._retry_at - time.monotonic()
        if wait_s > 0:  # the agent was lost a moment ago: a miss now, not a stall per call
            raise AgentUnreachable(f"agent {self._channel.url} lost; retrying in {wait_s:.2f} s")
        self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
        self._drop()
        hello = self._channel.connect()
        nv = hello["nvme"]
        try:
            self._nvme = NvmeTcpController.connect(
                nv["host"],
                int(nv["port"]),
                subnqn=nv["subnqn"],
                hostnqn=self._channel.hostnqn,
                io_queues=self._io_queues,
                dhchap_key=nv.get("dhchap_key"),  # issued by the agent (docs/NVME_AUTH.md)
                psk=nv.get("psk"),
            )
        except (OSError, NvmeError) as e:
            self._channel.close()
            raise AgentUnreachable(f"NVMe/TCP {nv['host']}:{nv['port']}: {e}") from None
        if self._xport.wanted != "nvme-tcp":
            self._xport.attach(self._channel, hello, _LOST)
        if self._lost_logged:
            log.warning("kvclient: agent %s is back", self._channel.url)
        self._lost_logged = False
        self._retry_at = 0.0
        return self._nvme

    def _drop(self) -> None:
        if self._nvme is not None:
            with contextlib.suppress(Exception):
                self._nvme.close()
            self._nvme = None

    def _lost(self, e: Exception) -> int:
        """The agent is gone or the data path broke: a miss, logged once per outage."""
        self._drop()
        self._channel.close()
        if not self._lost_logged:
            reason = e.message if isinstance(e, ControlError) else f"{type(e).__name__}: {e}"
            log.warning("kvclient: agent lost (%s); serving misses until it is back", reason)
            self._lost_logged = True
        return 0

    # --- public calls -----------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading full chunks of `tokens` the tier holds."""
        return self.lookup_keys(self.keys(tokens))

    def get(self, tokens: Sequence[int] | np.ndarray, into: Sequence[Any]) -> int:
        """Load the cached prefix into `into[0..]`; returns how many leading chunks were loaded.

        Each buffer holds layout.chunk_bytes; every chunk's checksum is verified, and the first
        failure or missing chunk ends the prefix.
        """
        return self.get_keys(self.keys(tokens), into)

    def put(self, tokens: Sequence[int] | np.ndarray, chunks: Sequence[Any]) -> int:
        """Store chunks of `tokens` (skipping those already cached); returns how many leading
        chunks the tier holds afterwards. One chunk buffer per full chunk of `tokens` (the
        partial last chunk is not stored)."""
        keys = self.keys(tokens)
        if len(chunks) != len(keys):
            raise ValueError(
                f"{len(tokens)} tokens make {len(keys)} full chunks of "
                f"{self.layout.chunk_tokens}, but {len(chunks)} chunk buffers were given: give "
                "one per full chunk (put_keys() stores a subset by key)"
            )
        return self.put_keys(keys, chunks)

    # --- key-level calls: for engines that name chunks themselves (LMCache) ------------------
    def lookup_keys(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of `keys` the tier holds."""
        return len(self.lookup_lengths(keys))

    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
        """The byte length of each leading cached chunk of `keys`: a buffer for get_keys()
        when chunks are not all layout.chunk_bytes long (LMCache objects)."""
        keys = _checked_keys(keys, "keys")
        if not keys:
            return []
        with self._lock:
            try:
                self._ensure()
                hits = self._channel.call("lookup", keys=keys, lease=False)["hits"]
            except _LOST as e:
                self._lost(e)
                return []
        return [int(h[4]) for h in hits]

    def get_keys(
        self, keys: Sequence[bytes], into: Sequence[Any], *, chunk_bytes: int | None = None
    ) -> int:
        """get() by key: load the cached prefix of `keys[:len(into)]` into `into[0..]`.

        Each buffer holds `chunk_bytes` (default layout.chunk_bytes); a stored chunk of another
        length is a miss. Checksums are verified as in get().
        """
        keys = _checked_keys(keys, "keys")[: len(into)]
        if not keys:
            return 0
        nbytes = self.layout.chunk_bytes if chunk_bytes is None else chunk_bytes
        if self._xport.wanted != "nvme-tcp":
            got = self._nixl_call("get", keys, into, nbytes)
            if got is not None:
                return got
        views = [byte_view(b, nbytes, writable=True) for b in into[: len(keys)]]
        with self._lock:
            try:
                return self._read(self._ensure(), keys, views)
            except _LOST as e:
                return self._lost(e)

    def put_keys(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> int:
        """put() by key: store `chunks` under `keys[:len(chunks)]` (skipping those already
        cached); returns how many leading chunks the tier holds afterwards.

        `parents[i]` is the key chunk i extends (the agent evicts children first); by default
        the previous key, None for the first. Each chunk holds `chunk_bytes` (default
        layout.chunk_bytes).
        """
        keys = _checked_keys(keys, "keys")
        if parents is None:
            parents = [None, *keys[:-1]]
        elif len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys: give one per key")
        else:
            _checked_keys([p for p in parents if p is not None], "parents")
        keys = keys[: len(chunks)]
        if not keys:
            return 0
        nbytes = self.layout.chunk_bytes if chunk_bytes is None else chunk_bytes
        if self._xport.wanted != "nvme-tcp":
            got = self._nixl_call("put", keys, chunks, nbytes, parents[: len(keys)])
            if got is not None:
                return got
        views = [byte_view(c, nbytes, writable=False) for c in chunks[: len(keys)]]
        with self._lock:
            try:
                self._ensure()
                cached = len(self._channel.call("lookup", keys=keys, lease=False)["hits"])
                return cached + self._write(keys, parents[: len(keys)], views, cached)
            except _LOST as e:
                return self._lost(e)

    def lease(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """lookup() that also leases the cached prefix (the agent neither evicts nor frees it
        until release_lease() or the lease TTL): (chunks, lease_id); lease_id 0 holds nothing.
        For a scheduler that promises chunks now and loads them a step later."""
        keys = self.keys(tokens)
        if not keys:
            return 0, 0
        with self._lock:
            try:
                self._ensure()
                res = self._channel.call("lookup", keys=keys)
            except _LOST as e:
                return self._lost(e), 0
        return len(res["hits"]), int(res["lease_id"] or 0)

    def release_lease(self, lease_id: int) -> None:
        """Give back a lease from lease(); a lost agent or an expired lease is not an error
        (the agent dropped it already)."""
        if not lease_id:
            return
        with self._lock:
            try:
                self._ensure()
                self._channel.post([("release", {"lease_id": lease_id})])
            except _LOST as e:
                self._lost(e)

    def delete(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Drop the chunks of `tokens`; returns how many were there."""
        keys = self.keys(tokens)
        if not keys:
            return 0
        with self._lock:
            try:
                self._ensure()
                replies = self._channel.pipeline([("delete", {"key": k}) for k in keys])
            except _LOST as e:
                return self._lost(e)
        return sum(1 for r in replies if r.ok)

    @property
    def transport(self) -> str:
        """The data path in use: "nixl" or "nvme-tcp" ("" before the first connect)."""
        return self._xport.transport or ("" if self._xport.wanted != "nvme-tcp" else "nvme-tcp")

    def _nixl_call(
        self, op: str, keys: list[bytes], bufs: Sequence[Any], nbytes: int,
        parents: Sequence[bytes | None] = (),
    ) -> int | None:  # fmt: skip
        """get/put over NIXL; None when this session uses NVMe/TCP (the caller goes on)."""
        with self._lock:
            try:
                self._ensure()
                path = self._xport.path
                if not self._xport.active or path is None:
                    return None
                if op == "get":
                    return path.get(self._channel, keys, bufs, nbytes)
                cached = len(self._channel.call("lookup", keys=keys, lease=False)["hits"])
                rest = slice(cached, len(keys))
                return cached + path.put(self._channel, keys[rest], parents[rest], bufs[rest],
                                         nbytes)  # fmt: skip
            except _LOST as e:
                return self._lost(e)
            except ControlError as e:  # NIXL failed on a live agent: NVMe/TCP from now on
                self._xport.fail(e)
                return None

    @property
    def channel(self) -> ControlChannel:
        """The control channel (stats, members, raw calls); connected on first use."""
        with self._lock:
            self._ensure()
        return self._channel

    async def prefetch(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Touch the cached prefix (the agent promotes it) without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.lookup, tokens)

    def close(self) -> None:
        # The pool first and outside the lock: a running prefetch may be waiting for the lock.
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._closed:
                return
            self._drop()
            self._channel.close()
            self._xport.close()
            self._closed = True

    # --- data path --------------------------------------------------------------------------
    def _read(self, nvme: NvmeTcpController, keys: list[bytes], views: list[memoryview]) -> int:
        """Lease, read and verify the cached prefix of `keys`; the lease is released (and a
        chunk that failed verification deleted) without waiting for the replies."""
        res = self._channel.call("lookup", keys=keys)
        hits = res["hits"]
        loaded = 0
        try:
            ok = self._parallel(nvme, [(h, views[i]) for i, h in enumerate(hits)], False)
            loaded = _leading(ok)
        finally:
            after: list[tuple[str, dict[str, Any]]] = []
            if res["lease_id"]:
                after.append(("release", {"lease_id": res["lease_id"]}))
            if loaded < len(hits):  # failed verification: never serve it again
                log.warning("kvclient: chunk %s failed verification", hits[loaded][0].hex())
                after.append(("delete", {"key": hits[loaded][0], "corrupt": True}))
            self._channel.post(after)  # no round trip: the next call reads the replies
        return loaded

    def _write(
        self,
        keys: list[bytes],
        parents: Sequence[bytes | None],
        views: list[memoryview],
        first: int,
    ) -> int:
        reqs = [
            ("reserve", {"key": keys[i], "length": len(views[i]), "parent": parents[i]})
            for i in range(first, len(keys))
        ]
        replies = self._channel.pipeline(reqs)
        granted: list[tuple[int, dict[str, Any]]] = []
        drop: list[int] = []  # reservations past the prefix: given back, not left to expire
        for i, reply in zip(range(first, len(keys)), replies, strict=True):
            if reply.ok and len(granted) == i - first:
                granted.append((i, dict(reply.result)))
            elif reply.ok:
                drop.append(reply.result["reservation_id"])
        nvme = self._nvme
        assert nvme is not None
        jobs = [
            ([keys[i], r["nsid"], r["lba"], r["block_count"], len(views[i]), b""], views[i])
            for i, r in granted
        ]
        sums = self._parallel(nvme, jobs, True)
        commits: list[tuple[str, dict[str, Any]]] = []
        for n, ((_, r), checksum) in enumerate(zip(granted, sums, strict=True)):
            if checksum and len(commits) == n:  # still a prefix of written chunks
                commits.append(("commit", {"reservation_id": r["reservation_id"],
                                           "checksum": checksum}))  # fmt: skip
            else:  # a failed write ends the prefix; what follows is given back
                drop.append(r["reservation_id"])
        aborts = [("abort", {"reservation_id": rid}) for rid in drop]
        done = self._channel.pipeline(commits + aborts)
        return _leading([bool(c.ok) for c in done[: len(commits)]])

    def _parallel(
        self, nvme: NvmeTcpController, jobs: list[tuple[list[Any], memoryview]], write: bool
    ) -> list[Any]:
        """Run every chunk's segments over the I/O queues; per chunk: ok/checksum or False.

        Writes hash each chunk in the pool while its bytes go out (xxh3 releases the GIL);
        reads verify each chunk here while later chunks are still arriving. Nothing is left
        running when this returns or raises: no I/O may touch a caller's buffer afterwards.
        """
        segments: list[list[Future[bool]]] = []
        sums: list[Future[bytes] | None] = []
        for hit, view in jobs:
            nsid, lba, length = int(hit[1]), int(hit[2]), int(hit[4])
            if length != len(view):  # a chunk of another size under this key: not ours
                segments.append([])
                sums.append(None)
                continue
            segments.append([self._pool.submit(_segment_io, nvme, nsid, lba, view, off, write)
                             for off in range(0, length, SEGMENT_BYTES)])  # fmt: skip
            sums.append(self._pool.submit(chunk_checksum, hit[0], view) if write else None)
        try:
            return [
                _outcome(hit, view, segs, csum, write)
                for (hit, view), segs, csum in zip(jobs, segments, sums, strict=True)
            ]
        except BaseException:
            pending: list[Future[Any]] = [f for segs in segments for f in segs]
            wait(pending + [f for f in sums if f is not None])
            raise


def _outcome(
    hit: list[Any],
    view: memoryview,
    segs: list[Future[bool]],
    csum: Future[bytes] | None,
    write: bool,
) -> Any:
    """The checksum of a written chunk, whether a read chunk verified, or False."""
    oks = [f.result() for f in segs]  # every segment settled, failed or not
    good = bool(oks) and all(oks)
    if write:
        checksum = csum.result() if csum is not None else b""
        return checksum if good else False
    return good and verify_checksum(hit[0], view, hit[5])


def _segment_io(
    nvme: NvmeTcpController, nsid: int, lba: int, view: memoryview, offset: int, write: bool
) -> bool:
    """One segment of a chunk: False when the target failed the command (that chunk is a
    miss); a broken connection raises NvmeTransportError (the agent is lost)."""
    try:
        _segment_io_raw(nvme, nsid, lba, view, offset, write)
    except NvmeStatusError:
        return False
    return True


def _segment_io_raw(
    nvme: NvmeTcpController, nsid: int, lba: int, view: memoryview, offset: int, write: bool
) -> None:
    """The partial last block goes through a zero-padded bounce buffer."""
    end = min(offset + SEGMENT_BYTES, len(view))
    seg_lba = lba + offset // BLOCK_BYTES
    whole = (end - offset) // BLOCK_BYTES * BLOCK_BYTES
    if whole:
        if write:
            nvme.write(nsid, seg_lba, view[offset : offset + whole])
        else:
            nvme.read(nsid, seg_lba, view[offset : offset + whole])
    tail = end - offset - whole
    if tail:
        bounce = bytearray(BLOCK_BYTES)
        tail_lba = seg_lba + whole // BLOCK_BYTES
        if write:
            bounce[:tail] = view[offset + whole : end]
            nvme.write(nsid, tail_lba, bounce)
        else:
            nvme.read(nsid, tail_lba, memoryview(bounce))
            view[offset + whole : end] = bounce[:tail]


def _checked_keys(keys: Sequence[bytes], what: str) -> list[bytes]:
    """`keys` as a list, or ValueError naming the first key that is not a 16-byte tier key."""
    if len(keys) > CHUNKS_PER_CALL_MAX:
        raise ValueError(
            f"{len(keys)} {what} in one call; at most {CHUNKS_PER_CALL_MAX}: split the call"
        )
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(
                f"{what}[{i}] is {key!r:.60}, not {KEY_BYTES} bytes; tier keys come from "
                "KVClient.keys() or a 16-byte hash of the engine's own key"
            )
    return list(keys)


def _leading(flags: Sequence[Any]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
