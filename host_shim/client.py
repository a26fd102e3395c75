"""KVClient: the host shim's client of the context-memory tier, and the control channel under it.

The control plane (kvproto.control frames over TCP or a Unix socket) finds chunks, leases them,
reserves room and commits; the bytes move over NVMe/TCP (host_shim.nvme) straight between the
agent's namespaces and the caller's buffers, several I/O queues at once. Every chunk read is
checked against the checksum its writer committed (kvproto.checksum): a mismatch ends the
prefix, it never hands back wrong KV. A lost agent is a miss, logged once, never an exception in
the inference loop; the next call reconnects.

    client = KVClient("tcp://127.0.0.1:7400", "default", token, layout, salt)
    n = client.get(tokens, [np.empty(layout.chunk_shape, np.float16) for _ in range(8)])

One interface (KVStore), two implementations: NodeClient (one agent, here) and
host_shim.cluster.ClusterRouter (a NodeClient per member of a cluster); KVClient holds the one
its URL names (`tcp://a:7400,b:7400`: a cluster; parse_client_url lists the forms).

The control channel (host_shim.control) is also what `dpuctl` uses for admin commands.
Transport failures raise AgentUnreachable; error replies raise ControlError with the agent's
code and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from host_shim._store import KVStore, _checked_keys, byte_view
from host_shim.cluster import ClusterRouter
from host_shim.control import (
    PIPELINE_BYTES_MAX,
    PIPELINE_DEPTH_MAX,
    AgentUnreachable,
    ControlChannel,
    ControlError,
    is_cluster_url,
    new_hostnqn,
    parse_client_url,
    parse_control_url,
)
from host_shim.nvme import NvmeError, NvmeStatusError, NvmeTcpController
from host_shim.transport import TransportSelector
from kvproto.checksum import chunk_checksum, verify_checksum
from kvproto.keys import ChunkLayout
from kvproto.nvme import BLOCK_BYTES

__all__ = [
    "PIPELINE_BYTES_MAX",
    "PIPELINE_DEPTH_MAX",
    "AgentUnreachable",
    "ControlChannel",
    "ControlError",
    "KVClient",
    "KVStore",
    "NodeClient",
    "byte_view",
    "is_cluster_url",
    "new_hostnqn",
    "parse_client_url",
    "parse_control_url",
]


# --- KVClient -------------------------------------------------------------------------------

log = logging.getLogger("host_shim.client")

# Bytes one data-path I/O moves: a 32 MiB chunk is split into this many-byte segments spread
# over the I/O queues, so decryption on the agent and the socket copies overlap.
SEGMENT_BYTES = 4 << 20
IO_QUEUES_MAX = 32  # one connection (and one agent thread) each; beyond this the DPU saturates
# a put's check of what the agent already holds: no lease, and not counted as a read's misses
_STORED_CHECK = {"lease": False, "count": False}
# After a failed connect, calls return misses at once for this long instead of each waiting
# for a connect timeout: the inference loop never stalls on a dead agent.
RECONNECT_BACKOFF_S = 0.5
# What a lost agent or a broken data path raises: a miss for the caller, never an exception.
_LOST = (AgentUnreachable, OSError, NvmeError)


class NodeClient(KVStore):
    """The tier's client of one agent: lookup, get, put and prefetch of KV chunks.

    `control` is ``tcp://host:port`` or ``unix:///path``; the NVMe/TCP address and subsystem
    come from the agent's hello. Calls are thread-safe. When the agent is lost, calls return
    0 (misses) and log once; the next call reconnects. `timeout_s` bounds every wait on the
    agent (connect, each reply, each NVMe/TCP PDU): the longest the agent may stay silent
    while a call waits on it. `on_lost(error)` runs when the agent is lost (a cluster router
    marks the node down).
    """

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
        on_lost: Callable[[Exception], None] | None = None,
        on_hot: Callable[[list[bytes]], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        assert 1 <= io_queues <= IO_QUEUES_MAX, io_queues
        # "nixl": the agent moves chunks into/out of registered buffers (host_shim.transport);
        # "auto": NIXL when both sides have it, NVMe/TCP otherwise; the log says which
        self._xport = TransportSelector(transport, tenant)
        self._channel = ControlChannel(control, tenant, token, hostnqn=hostnqn,
                                       timeout_s=timeout_s, ssl_context=ssl_context)  # fmt: skip
        self._io_queues = io_queues
        self._timeout_s = timeout_s
        self._on_lost = on_lost
        self._on_hot = on_hot
        self._nvme: NvmeTcpController | None = None
        self._pool = ThreadPoolExecutor(max_workers=io_queues, thread_name_prefix="kvclient-io")
        self._lock = threading.RLock()
        self._lost_logged = False
        self._retry_at = 0.0  # monotonic time before which a lost agent is not retried
        self._closed = False
        self._init_keys(layout, salt)

    def __repr__(self) -> str:
        return f"NodeClient({self._channel.url!r}, tenant={self._channel.tenant!r})"

    @property
    def url(self) -> str:
        return self._channel.url

    # --- connection -------------------------------------------------------------------------
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
                timeout_s=self._timeout_s,  # the same bound as the control channel's
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

    def probe(self) -> bool:
        """Connect now if not connected (a circuit breaker's probe); True when connected."""
        with self._lock:
            if self._closed:
                return False
            self._retry_at = 0.0  # a probe connects now, whatever the backoff says
            try:
                self._ensure()
                self._channel.call("stats")
            except _LOST as e:
                self._lost(e, notify=False)
                return False
            return True

    def _drop(self, *, abort: bool = False) -> None:
        if self._nvme is not None:
            with contextlib.suppress(Exception):
                if abort:  # the agent stopped answering: the shutdown handshake would wait
                    self._nvme.abort()
                else:
                    self._nvme.close()
            self._nvme = None

    def _lost(self, e: Exception, *, notify: bool = True) -> int:
        """The agent is gone or the data path broke: a miss, logged once per outage. Closing
        never waits on the agent (it may be the reason we are here)."""
        self._drop(abort=True)
        self._channel.close()
        # the next calls are misses at once for a while, not another timeout each (a miss
        # during that while does not extend it)
        now = time.monotonic()
        if self._retry_at <= now:
            self._retry_at = now + RECONNECT_BACKOFF_S
        if not self._lost_logged:
            reason = e.message if isinstance(e, ControlError) else f"{type(e).__name__}: {e}"
            log.warning("kvclient: agent lost (%s: %s); serving misses until it is back",
                        self._channel.url, reason)  # fmt: skip
            self._lost_logged = True
        if notify and self._on_lost is not None:
            self._on_lost(e)
        return 0

    # --- key-level calls --------------------------------------------------------------------
    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
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
                cached = len(self._channel.call("lookup", **_STORED_CHECK, keys=keys)["hits"])
                return cached + self._write(keys, parents[: len(keys)], views, cached)
            except _LOST as e:
                return self._lost(e)

    def lease_keys(self, keys: list[bytes]) -> tuple[int, int]:
        keys = _checked_keys(keys, "keys")
        if not keys:
            return 0, 0
        with self._lock:
            try:
                self._ensure()
                res = self._channel.call("lookup", keys=keys)
            except _LOST as e:
                return self._lost(e), 0
        self._note_hot(keys, res)
        return len(res["hits"]), int(res["lease_id"] or 0)

    def release_lease(self, lease_id: int) -> None:
        if not lease_id:
            return
        with self._lock:
            try:
                self._ensure()
                self._channel.post([("release", {"lease_id": lease_id})])
            except _LOST as e:
                self._lost(e)

    def delete_keys(self, keys: list[bytes]) -> int:
        return sum(self.deleted(keys))

    def deleted(self, keys: list[bytes]) -> list[bool]:
        """Drop `keys`; per key whether it was there (all False when the agent is lost)."""
        keys = _checked_keys(keys, "keys")
        if not keys:
            return []
        with self._lock:
            try:
                self._ensure()
                replies = self._channel.pipeline([("delete", {"key": k}) for k in keys])
            except _LOST as e:
                self._lost(e)
                return [False] * len(keys)
        return [bool(r.ok) for r in replies]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            try:
                self._ensure()
                return self._channel.call("stats")
            except _LOST as e:
                self._lost(e)
                raise AgentUnreachable(f"agent {self._channel.url} does not answer: {e}") from None

    @property
    def transport(self) -> str:
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
                cached = len(self._channel.call("lookup", **_STORED_CHECK, keys=keys)["hits"])
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

    def abort(self) -> None:
        """close() for an agent that stopped answering: nothing waits on it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._closed:
                return
            self._drop(abort=True)
            self._channel.close()
            self._xport.close()
            self._closed = True

    def _note_hot(self, keys: list[bytes], res: dict[str, Any]) -> None:
        """A cluster owner marks the keys it sees read often by every client (`hot`: indexes
        into `keys`); the router spreads their reads over the extra copies the owner made."""
        hot = res.get("hot")
        if self._on_hot is None or not hot or not isinstance(hot, list):
            return
        self._on_hot([keys[i] for i in hot if isinstance(i, int) and 0 <= i < len(keys)])

    # --- data path --------------------------------------------------------------------------
    def _read(self, nvme: NvmeTcpController, keys: list[bytes], views: list[memoryview]) -> int:
        """Lease, read and verify the cached prefix of `keys`; the lease is released (and a
        chunk that failed verification deleted) without waiting for the replies."""
        res = self._channel.call("lookup", keys=keys)
        self._note_hot(keys, res)
        hits = res["hits"]
        loaded = 0
        ok: list[Any] = []  # stays empty when the data path broke: nothing was verified
        try:
            ok = self._parallel(nvme, [(h, views[i]) for i, h in enumerate(hits)], False)
            loaded = _leading(ok)
        finally:
            after: list[tuple[str, dict[str, Any]]] = []
            if res["lease_id"]:
                after.append(("release", {"lease_id": res["lease_id"]}))
            # Only a checksum that did not match is corruption: a command the target failed,
            # a chunk of another size or a broken connection (no answer within the timeout)
            # is a miss, and the chunk stays for the next reader.
            if loaded < len(ok) and ok[loaded] is False:
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


class KVClient(KVStore):
    """The client applications use, for one agent or a cluster: the same calls either way.

    ``KVClient("tcp://127.0.0.1:7400", tenant, token, layout, salt)`` talks to one agent
    (a NodeClient); a URL with a comma (``tcp://a:7400,b:7400``, ``tcp://seed:7400,``) routes
    each key to its owners over every member (host_shim.cluster.ClusterRouter, one NodeClient
    per member). `parse_client_url` lists the URL forms.

    `timeout_s`: with one agent, the longest a call waits on it (connect, each reply); in a
    cluster, the budget for reaching any seed when there is no member list yet.
    `node_deadline_s` (clusters; default host_shim.cluster.NODE_DEADLINE_S): the longest a
    call waits on one member before that member is marked down and skipped
    (docs/CLUSTER.md, "Failures cost a deadline, once").
    """

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
        node_deadline_s: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        seeds = parse_client_url(control)
        if (
            isinstance(io_queues, bool)
            or not isinstance(io_queues, int)
            or not (1 <= io_queues <= IO_QUEUES_MAX)
        ):  # from a config (LMCache's dpukv.io_queues): a clear error now, not an assert later
            raise ValueError(
                f"io_queues={io_queues!r}: give an integer from 1 to {IO_QUEUES_MAX} "
                "(LMCache: extra_config dpukv.io_queues)"
            )
        self._init_keys(layout, salt)
        self.router: ClusterRouter | None = None
        impl: KVStore
        if is_cluster_url(control):
            impl = self.router = ClusterRouter(
                seeds, tenant, token, layout, salt, io_queues=io_queues, timeout_s=timeout_s,
                hostnqn=hostnqn, transport=transport, node_deadline_s=node_deadline_s,
                ssl_context=ssl_context, node_client=NodeClient,
            )  # fmt: skip
        else:
            impl = NodeClient(
                control, tenant, token, layout, salt, io_queues=io_queues,
                timeout_s=timeout_s, hostnqn=hostnqn, transport=transport,
                ssl_context=ssl_context,
            )  # fmt: skip
        self._impl = impl
        self.url = control

    def __repr__(self) -> str:
        return f"KVClient({self.url!r}, {self._impl!r})"

    @property
    def node(self) -> NodeClient | None:
        """The single agent's client (None for a cluster URL)."""
        return self._impl if isinstance(self._impl, NodeClient) else None

    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
        return self._impl.lookup_lengths(keys)

    def get_keys(
        self, keys: Sequence[bytes], into: Sequence[Any], *, chunk_bytes: int | None = None
    ) -> int:
        return self._impl.get_keys(keys, into, chunk_bytes=chunk_bytes)

    def put_keys(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> int:
        return self._impl.put_keys(keys, chunks, parents, chunk_bytes=chunk_bytes)

    def lease_keys(self, keys: list[bytes]) -> tuple[int, int]:
        return self._impl.lease_keys(keys)

    def release_lease(self, lease_id: int) -> None:
        self._impl.release_lease(lease_id)

    def delete_keys(self, keys: list[bytes]) -> int:
        return self._impl.delete_keys(keys)

    @property
    def transport(self) -> str:
        return self._impl.transport

    @property
    def channel(self) -> ControlChannel:
        return self._impl.channel

    def stats(self) -> dict[str, Any]:
        return self._impl.stats()

    async def prefetch(self, tokens: Sequence[int] | np.ndarray) -> int:
        return await self._impl.prefetch(tokens)

    def close(self) -> None:
        self._impl.close()


def _outcome(
    hit: list[Any],
    view: memoryview,
    segs: list[Future[bool]],
    csum: Future[bytes] | None,
    write: bool,
) -> Any:
    """A written chunk: its checksum, or False. A read chunk: whether it verified, or None
    when it was not read (a command the target failed, or a chunk of another size)."""
    oks = [f.result() for f in segs]  # every segment settled, failed or not
    good = bool(oks) and all(oks)
    if write:
        checksum = csum.result() if csum is not None else b""
        return checksum if good else False
    return verify_checksum(hit[0], view, hit[5]) if good else None


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


def _leading(flags: Sequence[Any]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
