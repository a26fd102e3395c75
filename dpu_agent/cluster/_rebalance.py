"""Rebalancing, anti-entropy and hot-prefix copies: what one node does so that every chunk it
holds ends up on exactly its owners, once, byte-identical.

After a view change a pass plans (dpu_agent.cluster._plan: work proportional to the keys whose
owners changed) and, for each such key this node holds, acts by rank among its old owners:

- the **sender** is the first old owner (settled view) that is still an alive member (serving
  or leaving); it writes the chunk to each new owner that lacks it (probed first: a write is
  only made where it is missing, and the counters count writes);
- any other holder that is no longer an owner waits until every owner holds the chunk, then
  drops its copy; if the sender turns out not to hold it, the waiting holder sends instead;
- a node whose own state is `leaving` keeps its copies (reads still find them there) until it
  is gone: the drain is over when every owner holds every chunk.

Passes are idempotent and resumable without a log (a newer view stops one; the next plans from
the last settled view again). Writes are throttled twice: this node's token bucket
(`bytes_per_s`) and the receiver's grant (`cluster_grant`: one bucket per receiving node, so a
joiner never takes N senders' rates). Progress (pending chunks and bytes, an ETA) is live.

A periodic round (`interval_s`) compares this node's chunks with the other owners' by
per-bucket digests of (key, checksum) (`cluster_digest`, Merkle-style, one level): a missing
replica is written, and replicas whose checksums differ are resolved to the lower checksum
(deterministic, no clocks), counted and logged. The same round drops copies this node holds
beyond the owners once the owners hold theirs, and ranks keys written since the last pass.

Hot prefixes are decided by the owner, from reads by every client (`note_reads` from the
control server's lookup): a chunk its first owner serves more than HOT_READS_PER_S times a
second is copied to the next HOT_EXTRA_REPLICAS nodes in rendezvous order; lookups answer
which keys are hot, so clients spread reads over the copies; a copy beyond R is kept while it
is read within HOT_TTL_S, then dropped like any surplus copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dpu_agent.cluster._peer import PeerAuth, open_peer
from dpu_agent.cluster._plan import OwnerTable, plan
from dpu_agent.engine.errors import EngineError
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from host_shim.client import ControlError, NodeClient
from kvproto.control import LOOKUP_KEYS_MAX
from kvproto.placement import REPLICAS_MAX, Node, Placement

__all__ = [
    "AE_BUCKETS",
    "GRANT_WAIT_S_MAX",
    "HOT_EXTRA_REPLICAS",
    "HOT_READS_PER_S",
    "HOT_TTL_S",
    "REBALANCE_BATCH_KEYS",
    "RebalanceProgress",
    "Rebalancer",
    "ReceiveLimiter",
    "TenantRows",
    "digest",
    "grant_wait",
    "tenant_keys",
    "tenant_rows",
]

log = get_logger("dpu_agent.cluster")

REBALANCE_BATCH_KEYS = 256  # keys acted on between checks for a newer view
WRITE_BATCH_KEYS = 32  # chunks per write call (and per receive grant) to one node
# The longest a sender waits on one grant's answer (a peer's answer must not park the pass);
# a grant's size is bounded by the wire (kvproto.control.GRANT_BYTES_MAX)
GRANT_WAIT_S_MAX = 300.0
PEER_CLIENTS_MAX = 1024  # one client per (tenant, owner) at most; a 1,024-node cluster
RETRY_S = 1.0  # a pass that left chunks pending runs again after this, doubling while stuck
RETRY_MAX_S = 30.0
ANTI_ENTROPY_INTERVAL_S = 30.0  # default; [cluster] anti_entropy_interval_s
# After a start that lost chunks (an unclean stop: a kill takes the DRAM tier), the rounds
# that also fetch back what this node first-owns and another owner holds, and how far apart
# they run (the first once the view settles): the other owner holds the only copy meanwhile,
# and a pull round that finds nothing missing costs digests only
PULL_ROUNDS = 3
PULL_ROUND_S = 2.0
PULL_CHUNKS_MAX = 65536  # fetched in one round at most (a tier's worth is refilled in rounds)
# Digest buckets: the top 8 bits of the key (a hash already). 256 digests are 2 KiB a peer and
# round; at 1M chunks a node, a bucket lists ~4K keys when it differs.
AE_BUCKETS = 256
AE_BUCKET_KEYS_MAX = 1 << 16  # a listed bucket's keys in one reply (about 3 MiB of msgpack)
# Hot prefixes (owner side): more than HOT_READS_PER_S reads a second, from all clients
# together, get HOT_EXTRA_REPLICAS more copies for HOT_TTL_S after the last read.
HOT_READS_PER_S = 20.0
HOT_EXTRA_REPLICAS = 2
HOT_TTL_S = 60.0
HOT_TRACK_MAX = 1 << 16  # keys whose read rate is tracked; the table resets when full
HOT_ASK_KEYS_MAX = LOOKUP_KEYS_MAX  # keys per `cluster_hot` question (a lookup's batch)
HOT_QUEUE_MAX = 1024  # chunks waiting to be copied; a burst beyond it waits for the next mark

MOVED_BYTES = Counter("kvtier_cluster_rebalance_bytes",
                      "Bytes written to other nodes by rebalancing (hand-offs, repairs, copies).",
                      registry=REGISTRY)  # fmt: skip
MOVED_CHUNKS = Counter("kvtier_cluster_rebalance_chunks",
                       "Chunks written to other nodes by rebalancing (each write once).",
                       registry=REGISTRY)  # fmt: skip
PENDING = Gauge("kvtier_cluster_rebalance_pending_chunks",
                "Chunks held here whose owners do not all hold them yet (live).",
                registry=REGISTRY)  # fmt: skip
PENDING_BYTES = Gauge("kvtier_cluster_rebalance_pending_bytes",
                      "Bytes of the pending chunks (the ETA is this over the rate).",
                      registry=REGISTRY)  # fmt: skip
DROPPED = Counter("kvtier_cluster_rebalance_dropped_chunks",
                  "Copies dropped here once every owner held the chunk (surplus included).",
                  registry=REGISTRY)  # fmt: skip
DIVERGENT = Counter("kvtier_cluster_divergent_replicas",
                    "Replicas found with another checksum than the owner's and resolved.",
                    registry=REGISTRY)  # fmt: skip
REPAIRED = Counter("kvtier_cluster_repaired_replicas",
                   "Missing replicas written by anti-entropy.", registry=REGISTRY)  # fmt: skip
PLAN_SECONDS = Counter("kvtier_cluster_plan_cpu_seconds",
                       "CPU seconds spent working out which keys a view change moves.",
                       registry=REGISTRY)  # fmt: skip
HOT_COPIES = Counter("kvtier_cluster_hot_copies",
                     "Extra copies of hot chunks written by their owner.",
                     registry=REGISTRY)  # fmt: skip


@dataclass(slots=True)
class RebalanceProgress:
    running: bool = False
    passes: int = 0
    epoch: int = 0  # the placement epoch of the current or last pass
    scanned: int = 0  # keys whose owners changed, acted on in the current or last pass
    ranked: int = 0  # keys ranked in full by the last plan (the O(N)-per-key part)
    plan_cpu_s: float = 0.0  # CPU time of the last plan
    moved_chunks: int = 0  # writes to new owners after view changes (all passes)
    moved_bytes: int = 0
    sent_chunks: int = 0  # every write to another node: moves, repairs, hot copies
    sent_bytes: int = 0
    dropped_chunks: int = 0  # copies dropped here once the owners held them
    kept_leaving: int = 0  # copies handed over but kept while leaving (current or last pass)
    pending: int = 0  # chunks held here whose owners do not all hold them yet (live)
    pending_bytes: int = 0
    eta_s: float = 0.0  # pending_bytes at the throttle's rate
    failed: int = 0  # chunks an owner did not take in this pass (retried)
    divergent: int = 0  # replicas with differing checksums resolved (all rounds)
    repaired: int = 0  # missing replicas written by anti-entropy (all rounds)
    ae_rounds: int = 0
    hot_copies: int = 0
    last_pass_s: float = 0.0
    pull_rounds_left: int = 0  # rounds that still fetch back what this node lost (a start)
    pulled: int = 0  # chunks fetched back by those rounds (all rounds)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class TenantRows:
    """A snapshot of one tenant's live chunks (the engine keeps serving meanwhile)."""

    keys: list[bytes]
    k64: np.ndarray  # the placement key (first 8 bytes)
    k1: np.ndarray  # key bytes 8..15
    c0: np.ndarray  # checksum words
    c1: np.ndarray
    length: np.ndarray
    idle_s: np.ndarray  # seconds since the last read (or the write)

    def checksum(self, i: int) -> bytes:
        return int(self.c0[i]).to_bytes(8, "little") + int(self.c1[i]).to_bytes(8, "little")


def tenant_rows(engine: Any, tenant: str) -> TenantRows:
    with engine.locked() as st:
        ts = st.tenant(tenant)
        idx = st.index
        rows = idx.live_rows()
        rows = rows[idx.cols["tenant"][rows] == ts.tenant_id]
        cols = {c: idx.cols[c][rows].copy() for c in ("k0", "k1", "c0", "c1", "length")}
        last = idx.cols["last_access"][rows].astype(np.float64)
        now = st.since_epoch()
    words = np.empty((len(rows), 2), dtype="<u8")
    words[:, 0], words[:, 1] = cols["k0"], cols["k1"]
    blob = words.tobytes()
    keys = [blob[i : i + 16] for i in range(0, len(blob), 16)]
    return TenantRows(keys, cols["k0"].astype(np.uint64), cols["k1"].astype(np.uint64),
                      cols["c0"], cols["c1"], cols["length"], now - last)  # fmt: skip


def tenant_keys(engine: Any, tenant: str) -> list[bytes]:
    """Every live key of `tenant` (a snapshot)."""
    return tenant_rows(engine, tenant).keys


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def digest(k64: np.ndarray, k1: np.ndarray, c0: np.ndarray, c1: np.ndarray) -> list[int]:
    """Per-bucket digests of (key, checksum): bucket = the key's top 8 bits; a bucket's digest
    is the XOR of a 64-bit mix of each key and checksum (order-free: both sides agree without
    sorting). Two owners holding the same versions of the same keys have equal digests."""
    out = np.zeros(AE_BUCKETS, dtype=np.uint64)
    if len(k64):
        h = _mix(k64 ^ _mix(k1.astype(np.uint64) ^ _mix(c0.astype(np.uint64) ^ _mix(
            c1.astype(np.uint64)))))  # fmt: skip
        np.bitwise_xor.at(out, (k64 >> np.uint64(56)).astype(np.int64), h)
    return [int(x) for x in out]


class ReceiveLimiter:
    """The receiving side's rate: senders ask for a grant before writing, and the answer is how
    long to wait; one bucket for all senders, so N senders share the rate instead of adding
    theirs. Debt-based: a grant is taken at once and paid for by waiting."""

    def __init__(self, bytes_per_s: float) -> None:
        assert bytes_per_s > 0, bytes_per_s
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._budget = 0.0
        self._at = time.monotonic()

    def grant(self, nbytes: int) -> float:
        with self._lock:
            now = time.monotonic()
            self._budget = min(self.bytes_per_s, self._budget + (now - self._at) * self.bytes_per_s)
            self._at = now
            self._budget -= nbytes
            return max(0.0, -self._budget / self.bytes_per_s)


def grant_wait(answer: Any) -> float | None:
    """The wait a `cluster_grant` answer asks for, at most GRANT_WAIT_S_MAX; None when the
    answer is not a grant (no `wait_s`, not a number, NaN, negative)."""
    try:
        wait_s = float(answer["wait_s"])
    except (TypeError, ValueError, KeyError, OverflowError):
        return None
    if not wait_s >= 0:  # NaN too
        return None
    return min(wait_s, GRANT_WAIT_S_MAX)


class Rebalancer:
    """One worker thread; `trigger()` after each membership change."""

    def __init__(
        self,
        *,
        engine: Any,
        node: str,
        placement: Callable[[], Placement],
        tenants: Callable[[], dict[str, tuple[str, int]]],  # tenant -> (token, replicas)
        bytes_per_s: float,
        peer_auth: PeerAuth | None,
        interval_s: float = ANTI_ENTROPY_INTERVAL_S,
        pull: bool = False,
    ) -> None:
        """`pull`: this node lost chunks it held (an unclean stop): its first rounds fetch
        back what it first-owns and another owner holds."""
        assert bytes_per_s > 0, bytes_per_s
        self._peer_auth = peer_auth  # None: no cluster key, so no peer is ever contacted
        self.engine, self.node = engine, node
        self._placement, self._tenants = placement, tenants
        self.bytes_per_s = bytes_per_s
        self.interval_s = interval_s
        self.progress = RebalanceProgress()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._clients: dict[tuple[str, str], NodeClient] = {}
        self._thread = threading.Thread(target=self._loop, name="cluster-rebalance", daemon=True)
        self._budget = 0.0
        self._budget_at = time.monotonic()
        # The view of the last pass that ended with nothing pending or failed, and the owners
        # of every key held then: a view change is planned against these.
        self._settled: Placement | None = None
        self._tables: dict[str, OwnerTable] = {}
        self._done: set[tuple[str, int]] = set()  # keys finished at _done_epoch
        self._done_epoch = 0
        self._retry = False
        self._retry_s = RETRY_S
        self._pass_t0 = time.monotonic()
        self._pass_bytes = 0  # written in the current pass (the ETA's rate)
        self._lock = threading.Lock()  # the hot-read table (control server thread)
        self._reads: dict[tuple[str, bytes], list[float]] = {}
        self._hot: dict[tuple[str, bytes], float] = {}  # -> monotonic time the mark lapses
        self._hot_queue: deque[tuple[str, bytes]] = deque()
        self.hot_reads_per_s = HOT_READS_PER_S  # 0 turns hot copies off
        self._pulled = 0  # chunks fetched in the current round
        self.progress.pull_rounds_left = PULL_ROUNDS if pull else 0

    def start(self) -> None:
        self._thread.start()
        self.trigger()

    def trigger(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        for c in self._clients.values():
            c.close()

    def _loop(self) -> None:
        pulling = self.progress.pull_rounds_left
        next_round = time.monotonic() + (PULL_ROUND_S if pulling else self.interval_s)
        while not self._stop.is_set():
            wait = self._retry_s if self._retry else max(0.0, next_round - time.monotonic())
            woke = self._wake.wait(0.0 if self._hot_queue else wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._copy_hot()
                if woke or self._retry:
                    self.run_pass()
                if time.monotonic() >= next_round:
                    if not self._retry:
                        self.run_round()
                    # pulling: the next round soon (also while the view is not settled yet)
                    wait = PULL_ROUND_S if self.progress.pull_rounds_left else self.interval_s
                    next_round = time.monotonic() + wait
            except Exception:  # a failing pass must not stop the agent; the next one retries
                log.exception("cluster_rebalance_failed")

    # --- the pass after a view change ----------------------------------------------------------
    def run_pass(self) -> RebalanceProgress:
        p = self.progress
        placement = self._placement()
        if self._settled is not None and self._settled.epoch == placement.epoch:
            self._retry = False
            return p  # settled at this view: nothing moves (new keys: the periodic round)
        if placement.epoch != self._done_epoch:
            self._done.clear()
            self._done_epoch = placement.epoch
        first = p.epoch != placement.epoch
        p.running, p.epoch, p.scanned, p.failed = True, placement.epoch, 0, 0
        p.kept_leaving = 0
        progress0 = (p.sent_chunks, p.dropped_chunks)
        t0 = self._pass_t0 = time.monotonic()
        self._pass_bytes = 0
        work: list[tuple[str, str, int, TenantRows, Any, np.ndarray]] = []
        tables: dict[str, OwnerTable] = {}
        cpu0 = time.process_time()
        ranked = 0
        for tenant, (token, replicas) in sorted(self._tenants().items()):
            r = max(1, min(REPLICAS_MAX, replicas))
            rows = tenant_rows(self.engine, tenant)
            pl = plan(rows.k64, r, placement, self._settled, self._tables.get(tenant))
            ranked += pl.ranked
            tables[tenant] = pl.table
            todo = [int(i) for i in np.flatnonzero(pl.changed)
                    if (tenant, int(rows.k64[i])) not in self._done]  # fmt: skip
            work.append((tenant, token, r, rows, pl, np.array(todo, dtype=np.int64)))
        p.plan_cpu_s = round(time.process_time() - cpu0, 4)
        p.ranked = ranked
        PLAN_SECONDS.inc(p.plan_cpu_s)
        self._set_pending(sum(len(w[5]) for w in work),
                          sum(int(w[3].length[w[5]].sum()) for w in work))  # fmt: skip
        try:
            for tenant, token, _r, rows, pl, idx in work:
                for i in range(0, len(idx), REBALANCE_BATCH_KEYS):
                    if self._stop.is_set() or self._placement().epoch != placement.epoch:
                        self._wake.set()  # a newer view: the next pass plans again
                        self._retry = True
                        return p
                    self._act(placement, tenant, token, rows, pl, idx[i : i + REBALANCE_BATCH_KEYS])
            if not p.pending and not p.failed:
                self._settled, self._tables, self._retry = placement, tables, False
            else:
                self._retry = True
        finally:
            p.running = False
            p.passes += 1
            p.last_pass_s = round(time.monotonic() - t0, 3)
            moved = (p.sent_chunks, p.dropped_chunks) != progress0
            # a stuck pass retries less and less often, and logs only when something changed
            self._retry_s = RETRY_S if moved or first else min(RETRY_MAX_S, 2 * self._retry_s)
            if moved or (first and (p.failed or p.pending)):
                log.info("cluster_rebalance_pass", **p.as_dict())
        return p

    def _set_pending(self, chunks: int, nbytes: int) -> None:
        p = self.progress
        p.pending, p.pending_bytes = max(0, chunks), max(0, nbytes)
        # at the rate this pass achieves (the receivers' grants included), else the throttle's
        took = time.monotonic() - self._pass_t0
        rate = self._pass_bytes / took if self._pass_bytes and took > 0 else self.bytes_per_s
        p.eta_s = round(p.pending_bytes / rate, 1) if p.pending_bytes else 0.0
        PENDING.set(p.pending)
        PENDING_BYTES.set(p.pending_bytes)

    def _finish(self, tenant: str, rows: TenantRows, i: int) -> None:
        self._done.add((tenant, int(rows.k64[i])))
        self._set_pending(self.progress.pending - 1,
                          self.progress.pending_bytes - int(rows.length[i]))  # fmt: skip

    def _act(
        self,
        placement: Placement,
        tenant: str,
        token: str,
        rows: TenantRows,
        pl: Any,
        idx: np.ndarray,
    ) -> None:
        """One batch of keys whose owners changed: send as the sender, drop once held."""
        me = self.node
        nodes = placement.by_name()
        alive = set(nodes)
        leaving = nodes.get(me) is not None and nodes[me].state == "leaving"
        sends: list[tuple[int, list[str], list[str]]] = []  # (i, targets, owners now)
        waits: list[tuple[int, str, list[str]]] = []  # (i, sender, owners now)
        for i in map(int, idx):
            self.progress.scanned += 1
            owners = [pl.names[j] for j in pl.after[i] if j >= 0]
            if not owners:  # nobody serves: keep everything until somebody does
                self.progress.failed += 1
                continue
            if pl.before is None:  # no settled view: the first owner (or a non-owner) sends
                sender = me if (me not in owners or owners[0] == me) else ""
                targets = [o for o in owners if o != me]
            else:
                old = [pl.before_names[j] for j in pl.before[i] if j >= 0]
                sender = next((o for o in old if o in alive), me)
                targets = [o for o in owners if o != me]  # probed: only the missing are written
            if me in owners and (sender != me or not targets):
                self._finish(tenant, rows, i)
            elif sender == me:
                sends.append((i, targets, owners))
            else:
                waits.append((i, sender, owners))
        # A waiting holder drops once every owner holds the chunk; if the sender lacks it,
        # it sends instead (the sender lost or never had it).
        if waits:
            held = self._held(tenant, token, nodes, rows, [(i, o) for i, _, o in waits])
            lacking = [(i, s, o) for i, s, o in waits if not held[i]]
            if lacking:
                has = self._probe_each(
                    tenant, token, nodes, rows, [(i, [s]) for i, s, _ in lacking]
                )
                for i, s, o in lacking:
                    if not has.get((i, s), False):
                        sends.append((i, [x for x in o if x != me], o))
            for i, _, _ in waits:
                if held[i]:
                    self._drop(tenant, rows, i, leaving)
        if sends:
            ok = self._send(tenant, token, nodes, rows, [(i, t) for i, t, _ in sends], moved=True)
            need_check = [(i, o) for i, _, o in sends if me not in o and ok[i] is True]
            held = self._held(tenant, token, nodes, rows, need_check) if need_check else {}
            for i, _, o in sends:
                if ok[i] is None:  # gone here (evicted or corrupt): nothing to hand over
                    self._finish(tenant, rows, i)
                elif not ok[i]:
                    self.progress.failed += 1
                elif me in o:
                    self._finish(tenant, rows, i)
                elif held.get(i):
                    self._drop(tenant, rows, i, leaving)

    def _drop(self, tenant: str, rows: TenantRows, i: int, leaving: bool) -> None:
        """Every owner holds chunk i: drop our copy, unless we are leaving (reads still come
        here until we are gone)."""
        if leaving:
            self.progress.kept_leaving += 1
        else:
            with contextlib.suppress(Exception):  # evicted meanwhile: gone either way
                self.engine.delete(tenant, rows.keys[i])
            self.progress.dropped_chunks += 1
            DROPPED.inc()
        self._finish(tenant, rows, i)

    # --- talking to other nodes -------------------------------------------------------------
    def _probe_each(
        self,
        tenant: str,
        token: str,
        nodes: dict[str, Node],
        rows: TenantRows,
        asks: Sequence[tuple[int, Sequence[str]]],
    ) -> dict[tuple[int, str], bool]:
        """Whether each named node holds chunk i (an unreachable node holds nothing)."""
        by_node: dict[str, list[int]] = {}
        for i, names in asks:
            for n in names:
                by_node.setdefault(n, []).append(i)
        out: dict[tuple[int, str], bool] = {}
        for name, idxs in by_node.items():
            got = self._has(tenant, token, nodes.get(name), [rows.keys[i] for i in idxs])
            for i, h in zip(idxs, got, strict=True):
                out[(i, name)] = h
        return out

    def _held(
        self,
        tenant: str,
        token: str,
        nodes: dict[str, Node],
        rows: TenantRows,
        asks: Sequence[tuple[int, list[str]]],
    ) -> dict[int, bool]:
        """Whether every other owner in the list holds chunk i."""
        me = self.node
        has = self._probe_each(tenant, token, nodes, rows,
                               [(i, [o for o in own if o != me]) for i, own in asks])  # fmt: skip
        return {i: all(has[(i, o)] for o in own if o != me) for i, own in asks}

    def _has(self, tenant: str, token: str, node: Node | None, keys: list[bytes]) -> list[bool]:
        if node is None or not keys:
            return [False] * len(keys)
        try:
            ch = self._peer(tenant, token, node).channel
            replies = ch.pipeline([("lookup", {"keys": [k], "lease": False}) for k in keys])
        except (ControlError, OSError):
            return [False] * len(keys)
        return [bool(r.ok and r.result["hits"]) for r in replies]

    def _send(
        self,
        tenant: str,
        token: str,
        nodes: dict[str, Node],
        rows: TenantRows,
        jobs: Sequence[tuple[int, list[str]]],
        *,
        moved: bool,
    ) -> dict[int, bool | None]:
        """Write chunk i to each of its targets that lacks it; per i: every target holds it
        (None: chunk i is no longer here)."""
        ok: dict[int, bool | None] = {i: True for i, _ in jobs}
        has = self._probe_each(tenant, token, nodes, rows, jobs)
        by_node: dict[str, list[int]] = {}
        for i, targets in jobs:
            for t in targets:
                if not has[(i, t)]:
                    by_node.setdefault(t, []).append(i)
        data: dict[int, bytes | None] = {}
        for name, idxs in sorted(by_node.items()):
            node = nodes.get(name)
            for b in range(0, len(idxs), WRITE_BATCH_KEYS):
                batch = idxs[b : b + WRITE_BATCH_KEYS]
                for i in batch:
                    if i not in data:  # checksum verified; None: gone or corrupt here
                        data[i] = self.engine.get_chunk(tenant, rows.keys[i])
                for i in batch:
                    if data[i] is None:
                        ok[i] = None
                batch = [i for i in batch if data[i] is not None]
                by_len: dict[int, list[int]] = {}
                for i in batch:
                    by_len.setdefault(len(data[i] or b""), []).append(i)
                for length, same in by_len.items():
                    blobs = [data[i] or b"" for i in same]
                    took = self._give_batch(tenant, token, node, [rows.keys[i] for i in same],
                                            blobs, length) if node is not None else 0  # fmt: skip
                    for n, i in enumerate(same):
                        if n < took:
                            self._count_write(length, moved=moved)
                        else:
                            ok[i] = False
        return ok

    def _count_write(self, nbytes: int, *, moved: bool) -> None:
        p = self.progress
        p.sent_chunks += 1
        p.sent_bytes += nbytes
        self._pass_bytes += nbytes
        if moved:
            p.moved_chunks += 1
            p.moved_bytes += nbytes
        MOVED_CHUNKS.inc()
        MOVED_BYTES.inc(nbytes)

    def _give(self, tenant: str, token: str, node: Node, key: bytes, data: bytes) -> bool:
        return self._give_batch(tenant, token, node, [key], [data], len(data)) == 1

    def _give_batch(
        self, tenant: str, token: str, node: Node, keys: list[bytes], blobs: list[bytes],
        length: int,
    ) -> int:  # fmt: skip
        """Write chunks to `node` at this node's rate and the receiver's: how many (leading)
        it holds afterwards."""
        nbytes = sum(map(len, blobs))
        self._throttle(nbytes)
        try:
            c = self._peer(tenant, token, node)
            # no grant, no write: a receiver that cannot answer yet (still starting) is retried
            # with the pass, never sent to at this sender's rate alone (N senders' rates)
            wait_s = grant_wait(c.channel.call("cluster_grant", bytes=nbytes))
            if wait_s is None:  # a malformed answer is no grant
                return 0
            if wait_s > 0:
                self._stop.wait(wait_s)
            return c.put_keys(keys, blobs, [None] * len(keys), chunk_bytes=length)
        except (ControlError, OSError):
            return 0

    def _replace(self, tenant: str, token: str, node: Node, key: bytes, data: bytes) -> bool:
        """Overwrite `node`'s copy of `key` (a write skips keys already held)."""
        try:
            with contextlib.suppress(ControlError):  # not there any more: just write it
                self._peer(tenant, token, node).channel.call("delete", key=key)
        except OSError:
            return False
        return self._give(tenant, token, node, key, data)

    def _peer(self, tenant: str, token: str, node: Node) -> NodeClient:
        """A peer connection (cluster/_peer.py): the tenant by name, never its token; a peer
        that fails the handshake takes nothing, so nothing is deleted on its word."""
        assert self._peer_auth is not None, "a rebalancer without the cluster key"
        c = self._clients.get((tenant, node.name))
        if c is None or c._channel.url != node.control:
            if len(self._clients) >= PEER_CLIENTS_MAX:
                for old in self._clients.values():
                    old.close()
                self._clients.clear()
            c = open_peer(node, tenant, self._peer_auth)
            self._clients[(tenant, node.name)] = c
        return c

    def _throttle(self, nbytes: int) -> None:
        """Token bucket: at most bytes_per_s on average, bursts of one second's worth."""
        now = time.monotonic()
        self._budget = min(
            self.bytes_per_s, self._budget + (now - self._budget_at) * self.bytes_per_s
        )
        self._budget_at = now
        self._budget -= nbytes
        if self._budget < 0:
            self._stop.wait(-self._budget / self.bytes_per_s)

    # --- the periodic round: surplus copies, anti-entropy --------------------------------------
    def run_round(self) -> dict[str, int]:
        """Rank keys written since the last pass, drop copies beyond the owners (once they hold
        theirs), and compare digests with the other owners. Only at a settled view."""
        placement = self._placement()
        stats = {"dropped": 0, "divergent": 0, "repaired": 0}
        if self._settled is None or self._settled.epoch != placement.epoch:
            return stats
        self.progress.ae_rounds += 1
        pulling, self._pulled = self.progress.pull_rounds_left > 0, 0
        stats["pulled"] = 0
        nodes = placement.by_name()
        leaving = nodes.get(self.node) is not None and nodes[self.node].state == "leaving"
        for tenant, (token, replicas) in sorted(self._tenants().items()):
            r = max(1, min(REPLICAS_MAX, replicas))
            rows = tenant_rows(self.engine, tenant)
            pl = plan(rows.k64, r, placement, placement, self._tables.get(tenant))
            self._tables[tenant] = pl.table
            if not leaving:
                stats["dropped"] += self._surplus(placement, tenant, token, r, rows, pl.after,
                                                  pl.names)  # fmt: skip
                got = self._anti_entropy(placement, tenant, token, rows, pl.after, pl.names,
                                         pull=pulling)  # fmt: skip
                stats["divergent"] += got[0]
                stats["repaired"] += got[1]
        if pulling:
            self.progress.pull_rounds_left -= 1
            stats["pulled"] = self._pulled
            self.progress.pulled += self._pulled
            log.info("cluster_pull_round", pulled=self._pulled,
                     rounds_left=self.progress.pull_rounds_left)  # fmt: skip
        return stats

    def _surplus(
        self, placement: Placement, tenant: str, token: str, r: int, rows: TenantRows,
        after: np.ndarray, names: tuple[str, ...],
    ) -> int:  # fmt: skip
        """Copies held here that this node does not own: dropped once every owner holds them,
        sent first where an owner lacks them; a hot copy read within HOT_TTL_S stays."""
        if self.node not in names:
            return 0
        me = names.index(self.node)
        stray = np.flatnonzero(~(after == me).any(axis=1))
        if not len(stray):
            return 0
        nodes = placement.by_name()
        wide = placement.owner_index(rows.k64[stray], min(r + HOT_EXTRA_REPLICAS, REPLICAS_MAX))
        ask: dict[str, list[int]] = {}  # first owner -> stray chunks that may be hot copies
        for i, w in zip(map(int, stray), wide, strict=True):
            if (w == me).any() and after[i, 0] >= 0:
                ask.setdefault(names[after[i, 0]], []).append(i)
        hot: set[int] = set()
        for name, idxs in ask.items():  # a hot copy stays while its first owner marks it hot
            hot.update(self._hot_at(tenant, token, nodes.get(name), rows, idxs))
        jobs = [(int(i), [names[j] for j in after[i] if j >= 0])
                for i in stray if int(i) not in hot]  # fmt: skip
        if not jobs:
            return 0
        ok = self._send(tenant, token, nodes, rows, jobs, moved=False)
        held = self._held(tenant, token, nodes, rows, [(i, o) for i, o in jobs if ok[i] is True])
        before = self.progress.dropped_chunks
        for i, _ in jobs:
            if held.get(i):
                self._drop(tenant, rows, i, False)
        n = self.progress.dropped_chunks - before
        if n:
            log.info("cluster_surplus_dropped", tenant=tenant, chunks=n)
        return n

    def _anti_entropy(
        self, placement: Placement, tenant: str, token: str, rows: TenantRows,
        after: np.ndarray, names: tuple[str, ...], *, pull: bool = False,
    ) -> tuple[int, int]:  # fmt: skip
        """As first owner, compare digests with each other owner; resolve what differs.
        `pull`: with every other member (what this node lost, any of them may co-own), and
        fetch what this node lacks."""
        if self.node not in names or after.shape[1] < 2:
            return 0, 0
        me = names.index(self.node)
        first = after[:, 0] == me
        nodes = placement.by_name()
        divergent = repaired = 0
        peers = {int(x) for x in after[first, 1:].ravel() if x >= 0}
        if pull:
            peers |= {j for j in range(len(names)) if j != me}
        for j in sorted(peers):
            peer = nodes.get(names[j])
            if peer is None:
                continue
            sel = first & (after[:, 1:] == j).any(axis=1)
            mine = digest(rows.k64[sel], rows.k1[sel], rows.c0[sel], rows.c1[sel])
            try:
                ch = self._peer(tenant, token, peer).channel
                theirs = ch.call("cluster_digest", coordinator=self.node, epoch=placement.epoch)
            except (ControlError, OSError) as e:
                log.info("cluster_anti_entropy_skipped", peer=peer.name, error=str(e))
                continue
            diff = [b for b, (x, y) in enumerate(zip(mine, theirs["digests"], strict=True))
                    if x != y]  # fmt: skip
            for b in diff:
                d, rep = self._resolve_bucket(tenant, token, peer, rows, sel, b, pull=pull)
                divergent += d
                repaired += rep
        return divergent, repaired

    def _resolve_bucket(
        self, tenant: str, token: str, peer: Node, rows: TenantRows, sel: np.ndarray, bucket: int,
        *, pull: bool = False,
    ) -> tuple[int, int]:  # fmt: skip
        placement = self._placement()
        try:
            ch = self._peer(tenant, token, peer).channel
            listed = ch.call("cluster_digest", coordinator=self.node, epoch=placement.epoch,
                             bucket=bucket)["keys"]  # fmt: skip
        except (ControlError, OSError):
            return 0, 0
        theirs = {bytes(k): (bytes(c), int(n)) for k, c, n in listed}
        mine_idx = np.flatnonzero(sel & ((rows.k64 >> np.uint64(56)) == bucket))
        mine = {rows.keys[i]: int(i) for i in mine_idx}
        divergent = repaired = 0
        for key in sorted(set(theirs) | set(mine)):
            i = mine.get(key)
            other = theirs.get(key)
            if i is not None and other is None:  # the peer lacks it: write it there
                data = self.engine.get_chunk(tenant, key)
                if data is not None and self._give(tenant, token, peer, key, data):
                    self._count_write(len(data), moved=False)
                    repaired += 1
                continue
            assert other is not None
            if i is None:  # we lack it (evicted here, or a write that failed): not our job,
                # unless this node lost what it held (a kill: its DRAM tier), where the other
                # owner's is the only copy left (an attack pass: a second kill lost it)
                if pull and self._pulled < PULL_CHUNKS_MAX:
                    self._throttle(other[1])
                    got = self._fetch(tenant, token, peer, key, other[1])
                    if got is not None and self._keep(tenant, key, got):
                        self._pulled += 1
                        repaired += 1
                continue
            ours = rows.checksum(i)
            if ours == other[0]:
                continue
            if ours < other[0]:  # ours wins: overwrite theirs
                data = self.engine.get_chunk(tenant, key)
                if data is not None and self._replace(tenant, token, peer, key, data):
                    self._count_write(len(data), moved=False)
                    divergent += 1
                    log.warning("cluster_divergent_replica", tenant=tenant, key=key.hex(),
                                kept=self.node, replaced=peer.name)  # fmt: skip
                continue
            got = self._fetch(tenant, token, peer, key, other[1])  # theirs wins
            if got is None:
                continue
            self.engine.put_chunk(tenant, key, got)  # replaces our version
            divergent += 1
            log.warning("cluster_divergent_replica", tenant=tenant, key=key.hex(),
                        kept=peer.name, replaced=self.node)  # fmt: skip
        self.progress.divergent += divergent
        self.progress.repaired += repaired
        DIVERGENT.inc(divergent)
        REPAIRED.inc(repaired)
        return divergent, repaired

    def _hot_at(
        self, tenant: str, token: str, node: Node | None, rows: TenantRows, idxs: list[int]
    ) -> list[int]:
        """Which of chunks `idxs` `node` (their first owner) marks hot."""
        if node is None:
            return []
        out: list[int] = []
        for b in range(0, len(idxs), HOT_ASK_KEYS_MAX):
            part = idxs[b : b + HOT_ASK_KEYS_MAX]
            try:
                ch = self._peer(tenant, token, node).channel
                got = ch.call("cluster_hot", keys=[rows.keys[i] for i in part])["hot"]
            except (ControlError, OSError):
                continue
            out += [part[int(n)] for n in got if 0 <= int(n) < len(part)]
        return out

    def hot_indexes(self, tenant: str, keys: Sequence[bytes]) -> list[int]:
        """`cluster_hot`: the indexes of `keys` this node marks hot now."""
        now = time.monotonic()
        with self._lock:
            return [n for n, k in enumerate(keys) if self._hot.get((tenant, k), 0.0) > now]

    def _keep(self, tenant: str, key: bytes, data: bytes) -> bool:
        """Store a fetched chunk here; False when the engine cannot take it now."""
        try:
            self.engine.put_chunk(tenant, key, data)
        except EngineError as e:  # full of leased chunks, a fenced journal: the next round
            log.info("cluster_pull_refused", tenant=tenant, error=str(e))
            return False
        return True

    def _fetch(self, tenant: str, token: str, node: Node, key: bytes, length: int) -> bytes | None:
        buf = bytearray(length)
        try:
            got = self._peer(tenant, token, node).get_keys([key], [buf], chunk_bytes=length)
        except (ControlError, OSError):
            return None
        return bytes(buf) if got == 1 else None

    # --- answering other nodes ------------------------------------------------------------------
    def answer_digest(self, tenant: str, replicas: int, fields: dict[str, Any]) -> dict[str, Any]:
        """`cluster_digest`: over the chunks held here whose first owner is the asking node
        (and of which this node is an owner), per-bucket digests, or one bucket's keys."""
        placement = self._placement()
        if int(fields["epoch"]) != placement.epoch:
            raise ValueError("membership epochs differ; compare again when both agree")
        names = tuple(n.name for n in placement.serving)
        coord, me = str(fields["coordinator"]), self.node
        rows = tenant_rows(self.engine, tenant)
        if coord not in names or me not in names:
            sel = np.zeros(len(rows.keys), dtype=bool)
        else:
            r = max(1, min(REPLICAS_MAX, replicas))
            pl = plan(rows.k64, r, placement, placement, self._tables.get(tenant))
            a = pl.after
            sel = (a[:, 0] == names.index(coord)) & (a == names.index(me)).any(axis=1)
        bucket = fields.get("bucket")
        if bucket is None:
            return {"digests": digest(rows.k64[sel], rows.k1[sel], rows.c0[sel], rows.c1[sel])}
        idx = np.flatnonzero(sel & ((rows.k64 >> np.uint64(56)) == int(bucket)))
        if len(idx) > AE_BUCKET_KEYS_MAX:
            raise ValueError(f"{len(idx)} keys in one digest bucket; more than "
                             f"{AE_BUCKET_KEYS_MAX}")  # fmt: skip
        return {"keys": [[rows.keys[i], rows.checksum(i), int(rows.length[i])]
                         for i in map(int, idx)]}  # fmt: skip

    # --- hot prefixes -----------------------------------------------------------------------------
    def note_reads(self, tenant: str, keys: Sequence[bytes]) -> list[int]:
        """Reads served here (every client's): which of `keys` are hot. A chunk that turns hot
        while this node is its first owner is queued to be copied to the next owners."""
        if self.hot_reads_per_s <= 0 or not keys:
            return []
        now = time.monotonic()
        hot: list[int] = []
        marked: list[bytes] = []
        with self._lock:
            if len(self._reads) >= HOT_TRACK_MAX:
                self._reads.clear()
            if len(self._hot) >= HOT_TRACK_MAX:
                self._hot = {k: t for k, t in self._hot.items() if t > now}
            for n, key in enumerate(keys):
                w = self._reads.setdefault((tenant, key), [now, 0.0])
                if now - w[0] > 1.0:
                    w[0], w[1] = now, 0.0
                w[1] += 1
                lapses = self._hot.get((tenant, key), 0.0)
                if w[1] > self.hot_reads_per_s:
                    if lapses < now:
                        marked.append(key)
                    self._hot[(tenant, key)] = lapses = now + HOT_TTL_S
                if lapses > now:
                    hot.append(n)
        if marked:
            placement = self._placement()
            for key in marked:
                owners = placement.owners(key, 1)
                if owners and owners[0].name == self.node and len(self._hot_queue) < HOT_QUEUE_MAX:
                    self._hot_queue.append((tenant, key))
            self._wake.set()
        return hot

    def _copy_hot(self) -> None:
        """Copy the queued hot chunks to the nodes after their R owners."""
        tenants = self._tenants()
        placement = self._placement()
        nodes = placement.by_name()
        while self._hot_queue:
            tenant, key = self._hot_queue.popleft()
            if tenant not in tenants:
                continue
            token, replicas = tenants[tenant]
            r = max(1, min(REPLICAS_MAX, replicas))
            wide = placement.owners(key, min(r + HOT_EXTRA_REPLICAS, REPLICAS_MAX))
            extra = [n.name for n in wide[r:] if n.name != self.node]
            data = self.engine.get_chunk(tenant, key)
            if data is None or not extra:
                continue
            for name in extra:
                node = nodes[name]
                if self._has(tenant, token, node, [key])[0]:
                    continue
                if self._give(tenant, token, node, key, data):
                    self._count_write(len(data), moved=False)
                    self.progress.hot_copies += 1
                    HOT_COPIES.inc()
