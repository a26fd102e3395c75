"""KVClient over a cluster of agents: owners by rendezvous hashing, no directory, no extra hop.

``KVClient("tcp://seed1:7400,seed2:7400", tenant, token, layout, salt)`` gives a
ClusterKVClient: it reads the member list (and its epoch, and the tenant's replica count R)
from any seed that answers, computes each key's owners with kvproto.placement exactly as the
agents do, splits every batch by owner and runs the per-node batches in parallel through one
single-node KVClient per member. Semantics stay those of one agent:

- a lookup's answer is the longest prefix cached across owners (each owner answers the
  longest prefix of its own keys; the first key no replica holds ends the prefix);
- reads go to the first owner and fall to the next replica for what it lacks; writes go to
  all R owners; a chunk counts as stored when any replica holds it;
- an unreachable owner is a miss, never an error to the engine (the per-node client logs it);
- requests carry the membership epoch; a node with another epoch answers ``moved``, and the
  client reads the member list again and retries once (MOVED_RETRIES_MAX).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from host_shim.client import (
    AgentUnreachable,
    ControlChannel,
    ControlError,
    KVClient,
    _checked_keys,
    byte_view,
    parse_control_url,
)
from kvproto.keys import ChunkLayout, chunk_keys
from kvproto.placement import REPLICAS_MAX, Node, Placement, keys64

__all__ = ["FANOUT_MAX", "ClusterKVClient", "EpochChannel"]

log = logging.getLogger("host_shim.cluster")

FANOUT_MAX = 16  # per-node batches in flight at once; beyond this threads cost more than help
MOVED_RETRIES_MAX = 1  # one re-read of the member list per call; still moved: misses
REFRESH_INTERVAL_S = 5.0  # re-read members at least this often (Serf converges in ~1 s)
SEED_TIMEOUT_S = 2.0  # connect timeout when asking a seed for the member list
SEEDS_MAX = 64  # addresses tried per refresh (seeds plus known members)
# Hot prefixes: a chunk this client reads more than HOT_READS_PER_S times a second gets
# HOT_EXTRA_REPLICAS more copies (the next owners in rendezvous order), and its reads spread
# over all of them: a shared system prompt read by every server must not pin one node.
HOT_READS_PER_S = 20.0
HOT_EXTRA_REPLICAS = 2
HOT_TTL_S = 60.0  # a hot mark lapses after this; the extra copies are soft (evictable)
HOT_TRACK_MAX = 1 << 16  # keys whose read rate is tracked; the table resets when full
T = TypeVar("T")


class EpochChannel(ControlChannel):
    """A control channel whose lookup and reserve requests carry the membership epoch."""

    epoch: int | None = None

    def _encode(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[int, bytes]]:
        if self.epoch is not None:
            requests = [
                (op, {**f, "epoch": self.epoch} if op in ("lookup", "reserve") else f)
                for op, f in requests
            ]
        return super()._encode(requests)


class _Moved(Exception):
    pass


class ClusterKVClient(KVClient):
    """KVClient's calls over every member of the cluster (see the module docstring)."""

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
    ) -> None:
        seeds = [u.strip() for u in control.split(",") if u.strip()]
        if not seeds:
            raise ValueError(f"cluster URL {control!r} names no seed; tcp://host:port,...")
        for url in seeds:
            parse_control_url(url)  # ValueError now, not mid-inference
        self.layout = layout
        self._salt = bytes(salt)
        self._seeds = seeds
        self._tenant, self._token = tenant, token
        self._node_opts: dict[str, Any] = {"io_queues": io_queues, "timeout_s": timeout_s,
                                           "hostnqn": hostnqn}  # fmt: skip
        self._clients: dict[str, KVClient] = {}
        self._placement = Placement([])
        self._previous: Placement | None = None
        self._epoch: int | None = None
        self.replicas = 1
        self._refreshed_at = 0.0
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=FANOUT_MAX, thread_name_prefix="kvcluster")
        self._closed = False
        self.moved_count = 0  # moved answers seen (stale views)
        self.hot_reads_per_s = HOT_READS_PER_S  # 0 turns hot-prefix replicas off
        self._reads: dict[bytes, list[float]] = {}  # key -> [window start, reads in it]
        self._hot: dict[bytes, float] = {}  # key -> monotonic time its mark lapses
        self._rng = np.random.default_rng()
        chunk_keys(np.zeros(0, dtype=np.uint32), salt=self._salt, layout_id=layout.layout_id,
                   chunk_tokens=layout.chunk_tokens)  # fmt: skip

    def __repr__(self) -> str:
        return f"ClusterKVClient({','.join(self._seeds)!r}, tenant={self._tenant!r})"

    # --- membership ----------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def refresh(self) -> bool:
        """Read the member list from the first seed or member that answers; False if none."""
        with self._lock:
            known = [n.control for n in self._placement.nodes if n.control]
            for url in list(dict.fromkeys([*known, *self._seeds]))[:SEEDS_MAX]:
                try:
                    ch = ControlChannel(
                        url, self._tenant, self._token, timeout_s=SEED_TIMEOUT_S, client="kvcluster"
                    )
                    with ch:
                        ch.connect()
                        res = ch.call("members")
                except (ControlError, OSError, ValueError):
                    continue
                self._apply(url, res)
                return True
            self._refreshed_at = time.monotonic()  # nobody answered: do not hammer the seeds
            return False

    def _apply(self, url: str, res: dict[str, Any]) -> None:
        rows = res.get("members") or []
        if res.get("epoch") is None:  # a single agent, not in cluster mode: it owns everything
            nodes = [Node(name=str(rows[0]["name"]) if rows else url, control=url)]
        else:
            nodes = [Node.from_dict(r) for r in rows if r.get("status") == "alive"]
        placement = Placement(nodes)
        if placement.epoch != self._placement.epoch and self._placement.serving:
            self._previous = self._placement  # reads fall back to it while chunks move
        self._placement = placement
        self._epoch = res.get("epoch")
        self.replicas = max(1, min(REPLICAS_MAX, int(res.get("replicas") or 1)))
        self._refreshed_at = time.monotonic()
        live = {n.name for n in nodes}
        for name in [n for n in self._clients if n not in live]:
            self._clients.pop(name).close()
        for c in self._clients.values():
            assert isinstance(c._channel, EpochChannel)
            c._channel.epoch = self._epoch

    def _client(self, node: Node) -> KVClient:
        with self._lock:  # pool threads ask at once: one client per member
            return self._client_locked(node)

    def _client_locked(self, node: Node) -> KVClient:
        c = self._clients.get(node.name)
        if c is None or c._channel.url != node.control:
            if c is not None:
                c.close()
            c = KVClient(node.control, self._tenant, self._token, self.layout, self._salt,
                         **self._node_opts)  # fmt: skip
            ch = c._channel
            c._channel = EpochChannel(ch.url, ch.tenant, self._token, hostnqn=ch.hostnqn,
                                      timeout_s=ch.timeout_s)  # fmt: skip
            c._channel.epoch = self._epoch
            self._clients[node.name] = c
        return c

    def _owners(self, keys: list[bytes]) -> tuple[list[Node], np.ndarray]:
        with self._lock:
            if time.monotonic() - self._refreshed_at > REFRESH_INTERVAL_S:
                self.refresh()
            p = self._placement
            owners = p.owner_index(keys64(keys), self.replicas)
            hot = [i for i, k in enumerate(keys) if k in self._hot] if self._hot else []
        if hot and len(p.serving) > owners.shape[1]:
            wide = p.owner_index(keys64([keys[i] for i in hot]), self.replicas + HOT_EXTRA_REPLICAS)
            out = np.full((len(keys), wide.shape[1]), -1, dtype=np.int64)
            out[:, : owners.shape[1]] = owners
            shift = self._rng.integers(0, wide.shape[1], size=len(hot))
            for j, i in enumerate(hot):  # a random copy first: reads spread over all of them
                out[i] = np.roll(wide[j], -int(shift[j]))
            owners = out
        return list(p.serving), owners

    def _note_reads(self, keys: list[bytes], into: Sequence[Any], loaded: int) -> None:
        """Count reads; a chunk that turns hot is copied (from `into`, now) to its extra owners."""
        if self.hot_reads_per_s <= 0 or not loaded:
            return
        now = time.monotonic()
        spread = []
        with self._lock:
            if len(self._reads) >= HOT_TRACK_MAX:
                self._reads.clear()
            for i, key in enumerate(keys[:loaded]):
                w = self._reads.setdefault(key, [now, 0.0])
                if now - w[0] > 1.0:
                    w[0], w[1] = now, 0.0
                w[1] += 1
                if w[1] > self.hot_reads_per_s and self._hot.get(key, 0.0) < now:
                    self._hot[key] = now + HOT_TTL_S
                    spread.append(
                        (key, bytes(byte_view(into[i], _nbytes(into[i]), writable=False)))
                    )
            if len(self._hot) > HOT_TRACK_MAX:
                self._hot = {k: t for k, t in self._hot.items() if t > now}
        for key, data in spread:
            self._pool.submit(self._spread, key, data)

    def _spread(self, key: bytes, data: bytes) -> None:
        """Write a hot chunk to the owners past its R (they cache it like any chunk)."""
        p = self._placement
        nodes = list(p.serving)
        owners = p.owner_index(keys64([key]), self.replicas + HOT_EXTRA_REPLICAS)[0]
        for n in owners[self.replicas :]:
            try:
                self._client(nodes[int(n)]).put_keys([key], [data], [None], chunk_bytes=len(data))
            except ControlError:
                continue  # moved or unreachable: the copy is an optimisation

    def _fallback(self, keys: list[bytes], tried: list[set[str]]) -> tuple[list[Node], np.ndarray]:
        """The previous view's first owners that still answer reads and were not asked: while
        a join's chunks move to their new owners, reads find them where they were; a leaving
        member (alive, state `leaving`, flagged `reads`) keeps its copies until it is gone."""
        with self._lock:
            prev = self._previous
            live = {n.name: n for n in self._placement.nodes if n.state in ("serving", "leaving")}
            if prev is None and any(n.state == "leaving" for n in self._placement.nodes):
                prev = Placement([replace(n, state="serving") for n in live.values()])
        if prev is None or not live:
            return [], np.empty(0, dtype=np.int64)
        nodes = [live.get(n.name) or n for n in prev.serving]
        idx = prev.primary_index(keys64(keys))
        keep = np.array([nodes[int(i)].name in live and nodes[int(i)].name not in tried[k]
                         for k, i in enumerate(idx)], dtype=bool)  # fmt: skip
        return nodes, np.where(keep, idx, -1)

    # --- fan-out -------------------------------------------------------------------------
    def _by_owner(
        self,
        keys: list[bytes],
        call: Callable[[KVClient, list[int]], int | list[int]],
    ) -> list[Any]:
        """Ask each key's owners, rank by rank, for the keys still unanswered. `call(client,
        idxs)` answers how many leading keys of `idxs` it served (or their lengths);
        returns per key what the serving replica answered (None: no replica)."""
        for attempt in range(MOVED_RETRIES_MAX + 1):
            try:
                return self._ranks(keys, call)
            except _Moved:
                self.moved_count += 1
                with self._lock:
                    self.refresh()
                if attempt == MOVED_RETRIES_MAX:
                    log.warning("kvcluster: members keep moving; serving misses this call")
        return [None] * len(keys)

    def _ranks(
        self, keys: list[bytes], call: Callable[[KVClient, list[int]], int | list[int]]
    ) -> list[Any]:
        nodes, owners = self._owners(keys)
        out: list[Any] = [None] * len(keys)
        pending = list(range(len(keys)))
        for rank in range(owners.shape[1]):
            pending = self._round(nodes, owners[:, rank], pending, call, out)
            if not pending:
                return out
        tried = [{nodes[int(j)].name for j in row if j >= 0} for row in owners]
        prev_nodes, prev = self._fallback(keys, tried)
        if len(prev) and pending:
            pending = [i for i in pending if prev[i] >= 0]
            self._round(prev_nodes, prev, pending, call, out)
        return out

    def _round(
        self,
        nodes: list[Node],
        owner: np.ndarray,
        pending: list[int],
        call: Callable[[KVClient, list[int]], int | list[int]],
        out: list[Any],
    ) -> list[int]:
        """Ask each node in `owner[pending]` for its keys; fill `out`; what is still missing."""
        groups: dict[int, list[int]] = {}
        missing: list[int] = []
        for i in pending:
            if owner[i] < 0:  # no owner at this rank (hot keys have more ranks than others)
                missing.append(i)
                continue
            groups.setdefault(int(owner[i]), []).append(i)
        jobs = {n: self._pool.submit(self._one, nodes[n], idxs, call)
                for n, idxs in groups.items()}  # fmt: skip
        for n, got in _settle(jobs).items():
            idxs = groups[n]
            served = got if isinstance(got, list) else [True] * got
            for i, value in zip(idxs, served, strict=False):
                out[i] = value
            missing += idxs[len(served) :]
        return sorted(missing)

    def _one(self, node: Node, idxs: list[int], call: Callable[..., Any]) -> Any:
        try:
            return call(self._client(node), idxs)
        except ControlError as e:
            if e.code == "moved":
                raise _Moved(node.name) from None
            if isinstance(e, AgentUnreachable):
                return 0
            raise

    # --- key-level calls -----------------------------------------------------------------
    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
        keys = _checked(keys)
        if not keys:
            return []
        got = self._by_owner(keys, lambda c, idxs: c.lookup_lengths([keys[i] for i in idxs]))
        return [int(x) for x in _prefix(got)]

    def get_keys(
        self, keys: Sequence[bytes], into: Sequence[Any], *, chunk_bytes: int | None = None
    ) -> int:
        keys = _checked(keys)[: len(into)]
        if not keys:
            return 0
        nbytes = self.layout.chunk_bytes if chunk_bytes is None else chunk_bytes
        for b in into[: len(keys)]:
            byte_view(b, nbytes, writable=True)  # ValueError here, before any I/O

        def read(c: KVClient, idxs: list[int]) -> int:
            return c.get_keys([keys[i] for i in idxs], [into[i] for i in idxs],
                              chunk_bytes=chunk_bytes)  # fmt: skip

        loaded = len(_prefix(self._by_owner(keys, read)))
        self._note_reads(keys, into, loaded)
        return loaded

    def put_keys(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> int:
        keys = _checked(keys)
        if parents is None:
            parents = [None, *keys[:-1]]
        elif len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys: give one per key")
        keys = keys[: len(chunks)]
        if not keys:
            return 0
        stored = [False] * len(keys)
        for attempt in range(MOVED_RETRIES_MAX + 1):
            try:
                nodes, owners = self._owners(keys)
                jobs = []
                for rank in range(owners.shape[1]):  # every replica, all ranks at once
                    groups: dict[int, list[int]] = {}
                    for i in range(len(keys)):
                        if owners[i, rank] >= 0:  # -1: fewer owners (hot keys have more)
                            groups.setdefault(int(owners[i, rank]), []).append(i)
                    put = _putter(keys, chunks, parents, chunk_bytes)
                    jobs += [
                        (idxs, self._pool.submit(self._one, nodes[n], idxs, put))
                        for n, idxs in groups.items()
                    ]
                for (idxs, _), took in zip(jobs, _settle(dict(enumerate(jobs))).values(),
                                           strict=True):  # fmt: skip
                    for i in idxs[:took]:
                        stored[i] = True
                break
            except _Moved:
                self.moved_count += 1
                with self._lock:
                    self.refresh()
                if attempt == MOVED_RETRIES_MAX:
                    log.warning("kvcluster: members keep moving; put stored what it could")
        return len(_prefix([True if s else None for s in stored]))

    def delete(self, tokens: Sequence[int] | np.ndarray) -> int:
        keys = self.keys(tokens)
        if not keys:
            return 0
        nodes, owners = self._owners(keys)
        found = 0
        for rank in range(owners.shape[1]):
            for i, key in enumerate(keys):
                if owners[i, rank] < 0:
                    continue
                c = self._client(nodes[int(owners[i, rank])])
                try:
                    c._ensure()
                    c._channel.call("delete", key=key)
                    found += rank == 0
                except ControlError:
                    continue
        return found

    @property
    def channel(self) -> ControlChannel:
        """The control channel of the first member (stats, members, raw calls)."""
        nodes, _ = self._owners([])
        if not nodes:
            raise AgentUnreachable(f"no member of {','.join(self._seeds)} answers")
        return self._client(nodes[0]).channel

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._closed:
                return
            for c in self._clients.values():
                c.close()
            self._clients.clear()
            self._closed = True


def _putter(
    keys: list[bytes], chunks: Sequence[Any], parents: Sequence[bytes | None],
    chunk_bytes: int | None,
) -> Callable[[KVClient, list[int]], int]:  # fmt: skip
    def put(c: KVClient, idxs: list[int]) -> int:
        return c.put_keys([keys[i] for i in idxs], [chunks[i] for i in idxs],
                          [parents[i] for i in idxs], chunk_bytes=chunk_bytes)  # fmt: skip

    return put


def _settle(jobs: dict[Any, Any]) -> dict[Any, Any]:
    """Every job's result once all have finished (none may still touch a caller's buffer);
    _Moved if any node answered moved."""
    results, moved = {}, False
    for name, job in jobs.items():
        fut = job[1] if isinstance(job, tuple) else job
        try:
            results[name] = fut.result()
        except _Moved:
            moved = True
    if moved:
        raise _Moved()
    return results


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if hasattr(buf, "nbytes") else len(memoryview(buf).cast("B"))


def _prefix(values: list[T | None]) -> list[T]:
    out: list[T] = []
    for v in values:
        if v is None:
            break
        out.append(v)
    return out


def _checked(keys: Sequence[bytes]) -> list[bytes]:
    return _checked_keys(keys, "keys")
