"""ClusterRouter: the tier's client over a cluster of agents, one NodeClient per member.

``KVClient("tcp://seed1:7400,seed2:7400", tenant, token, layout, salt)`` routes through a
ClusterRouter: it reads the member list (and its epoch, and the tenant's replica count R)
from a member or seed, computes each key's owners with kvproto.placement exactly as the
agents do, splits every batch by owner and runs the per-node batches in parallel through one
NodeClient per member. Semantics stay those of one agent:

- a lookup's answer is the longest prefix cached across owners (each owner answers the
  longest prefix of its own keys; the first key no replica holds ends the prefix);
- reads go to the first owner and fall to the next replica for what it lacks; writes go to
  all R owners; a chunk counts as stored when any replica committed it;
- an unreachable owner is a miss, never an error to the engine;
- requests carry the membership epoch; a node with another epoch answers ``moved``, and the
  client reads the member list again and retries once (MOVED_RETRIES_MAX).

Failures cost one deadline, once: every wait on a member is bounded by the per-node deadline
(NODE_DEADLINE_S); a member that misses it (or refuses the connection) is marked down and
skipped by every call until a probe (every PROBE_INTERVAL_S, off the call path) or the
member list says it is back. No lock is held across I/O to a member: a call never waits on
another member's failure. The member list is refreshed off the call path, from a member
picked at random (spread over the cluster), as a delta against the epoch the client holds.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from host_shim._store import KVStore, _checked_keys, byte_view
from host_shim.control import AgentUnreachable, ControlChannel, ControlError
from kvproto.control import LOOKUP_KEYS_MAX, ProtocolError
from kvproto.keys import ChunkLayout
from kvproto.placement import REPLICAS_MAX, Node, Placement, keys64

if TYPE_CHECKING:
    from host_shim.client import NodeClient

__all__ = [
    "FANOUT_MAX",
    "NODE_DEADLINE_S",
    "PROBE_INTERVAL_S",
    "ClusterRouter",
    "EpochChannel",
]

log = logging.getLogger("host_shim.cluster")

FANOUT_MAX = 16  # per-node batches in flight at once; beyond this threads cost more than help
MOVED_RETRIES_MAX = 1  # one re-read of the member list per call; still moved: misses
# The per-node deadline: the longest a call waits on one member (connect, a reply, an
# NVMe/TCP PDU) before that member is marked down. A LAN round trip is ~0.1 ms and an
# agent answers a control request in about a millisecond and a 4 MiB segment in a few
# (docs/MEASURED.md); 250 ms is two orders of magnitude above that, so a live member under
# load does not trip it, and far below what an engine step can absorb (a miss costs a
# recompute; a stall of seconds stalls every request in the batch). Configurable per client
# (KVClient(node_deadline_s=...)) for slower networks.
NODE_DEADLINE_S = 0.25
PROBE_INTERVAL_S = 1.0  # a down member is probed (connect + one request) this often
REFRESH_INTERVAL_S = 5.0  # re-read members at least this often (Serf converges in ~1 s)
REFRESH_AGREE = 2  # answers that must agree on a new epoch before the client moves to it
SEEDS_MAX = 64  # addresses tried per refresh (members plus seeds)
MAINT_TICK_S = 0.2  # the maintenance thread's wake-up: probes and refreshes run off calls
# Cluster leases remembered (a few member lease ids each): a scheduler holds a lease for a few
# steps of a batch of at most a few thousand requests, so 64 Ki is far beyond what is live;
# a forgotten one is not released early and lapses at the agents' lease TTL.
LEASES_MAX = 1 << 16
# Copies a down replica missed, remembered for the handoff when it is back: a key and a few
# numbers each (~100 bytes), so 64 Ki hints are ~6 MiB; past that the oldest are dropped
# (counted) and those copies wait for the next change of their owners (the rebalancer).
HINTS_MAX = 1 << 16
REFRESH_SOURCES_MAX = 64  # recent refreshes kept for stats(): five minutes at one per 5 s
# Hot prefixes are decided by their first owner, from every client's reads (it copies them to
# the next HOT_EXTRA_REPLICAS owners and marks them `hot` in lookup replies); the router then
# reads them from a random one of those copies for HOT_TTL_S: a shared system prompt read by
# every server must not pin one node.
HOT_EXTRA_REPLICAS = 2  # as the owner's (dpu_agent.cluster._rebalance)
HOT_TTL_S = 60.0
HOT_TRACK_MAX = 1 << 16  # hot marks remembered; expired ones dropped past it
T = TypeVar("T")


# Refusals by one member that cost a miss there, not an error: `auth` (a tenant change that has
# not reached that member yet, or one it could not apply), `unavailable` (a member cut off from
# the cluster refuses writes). A wrong token fails the router's member-list refresh instead.
MISS_CODES = frozenset({"auth", "unavailable"})


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


class _Breaker:
    """Which members are down: tripped by a missed deadline or a refused connection,
    cleared by a probe or by the member list (the member left and came back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # name -> monotonic time of the next probe
        self.trips = 0

    def is_down(self, name: str) -> bool:
        return name in self._down

    def down(self) -> list[str]:
        with self._lock:
            return sorted(self._down)

    def trip(self, name: str) -> bool:
        with self._lock:
            if name in self._down:
                return False
            self._down[name] = time.monotonic() + PROBE_INTERVAL_S
            self.trips += 1
            return True

    def clear(self, name: str) -> bool:
        with self._lock:
            return self._down.pop(name, None) is not None

    def due(self) -> list[str]:
        """Down members whose probe is due (each is then due again a PROBE_INTERVAL_S on)."""
        now = time.monotonic()
        with self._lock:
            names = [n for n, t in self._down.items() if t <= now]
            for n in names:
                self._down[n] = now + PROBE_INTERVAL_S
            return names


class ClusterRouter(KVStore):
    """The KVStore calls over every member of the cluster (see the module docstring)."""

    def __init__(
        self,
        seeds: list[str],
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
        node_client: Callable[..., NodeClient],
    ) -> None:
        """`node_client` builds the client of one member (KVClient passes NodeClient: this
        module is below host_shim.client, which imports it)."""
        assert seeds, "parse_client_url gives at least one seed"
        self._node_client = node_client
        self._init_keys(layout, salt)
        self._seeds = list(seeds)
        self._tenant, self._token = tenant, token
        self.deadline_s = NODE_DEADLINE_S if node_deadline_s is None else float(node_deadline_s)
        if not 0 < self.deadline_s <= 60:
            raise ValueError(f"node_deadline_s {self.deadline_s}: give seconds in (0, 60]")
        self._seed_budget_s = max(timeout_s, self.deadline_s)
        self._node_opts: dict[str, Any] = {
            "io_queues": io_queues, "timeout_s": self.deadline_s, "hostnqn": hostnqn,
            "transport": transport, "ssl_context": ssl_context,
        }  # fmt: skip
        self._ssl = ssl_context
        self._wanted_transport = transport
        self._clients: dict[str, NodeClient] = {}
        self._rows: dict[str, dict[str, Any]] = {}  # member name -> its row in `members`
        self._placement = Placement([])
        self._previous: Placement | None = None
        self._epoch: int | None = None
        self.replicas = 1
        self._refreshed_at = 0.0
        self._lock = threading.Lock()  # guards the maps above; never held across I/O
        self._refreshing = threading.Lock()  # one refresh at a time (others use the view)
        self._breaker = _Breaker()
        self._refusals_logged: set[tuple[str, str]] = set()  # (member, code) logged once
        self._leases: OrderedDict[int, list[tuple[str, int]]] = OrderedDict()
        # (member, key) -> (chunk bytes, parent): copies a down member missed (hinted handoff)
        self._hints: OrderedDict[tuple[str, bytes], tuple[int, bytes | None]] = OrderedDict()
        # (member, key): deletes a down member missed, replayed when it is back (without them
        # a member frozen during a delete served the chunk again after the heal, and its
        # anti-entropy copied it back to the other owners: an attack pass, 14 of 14 keys)
        self._delete_hints: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.hints_replayed = 0  # copies handed to a member that came back
        self.hints_dropped = 0  # hints dropped at HINTS_MAX (left to the rebalancer)
        self._next_lease = 1
        self._pool = ThreadPoolExecutor(max_workers=FANOUT_MAX, thread_name_prefix="kvcluster")
        self._closed = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.moved_count = 0  # moved answers seen (stale views)
        # recent refreshes: (member or seed that answered, member rows its answer carried)
        self.refreshes: deque[tuple[str, int]] = deque(maxlen=REFRESH_SOURCES_MAX)
        self.refresh_rows = 0  # member rows the last refresh carried (0: unchanged)
        self.spread_hot_reads = True  # read owners' hot keys from any copy (False: first owners)
        self._hot: dict[bytes, float] = {}  # key -> monotonic time its mark lapses
        self._rng = np.random.default_rng()
        self._maint = threading.Thread(target=self._maintain, name="kvcluster-maint", daemon=True)
        self._maint.start()

    def __repr__(self) -> str:
        return f"ClusterRouter({','.join(self._seeds)!r}, tenant={self._tenant!r})"

    # --- membership ----------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def down(self) -> list[str]:
        """Members marked down (skipped until a probe or the member list says they are back)."""
        return self._breaker.down()

    def refresh(self, budget_s: float | None = None, prefer: str = "") -> bool:
        """Read the member list from one member or seed that answers, starting at a random
        member (refreshes spread over the cluster) and asking only for what changed since the
        epoch held; False when none answered within `budget_s` (default: the seed budget)."""
        budget = self._seed_budget_s if budget_s is None else budget_s
        if not self._refreshing.acquire(timeout=budget):
            return False  # another thread is refreshing; the view it gets serves us too
        try:
            return self._refresh(time.monotonic() + budget, prefer)
        finally:
            self._refreshing.release()

    def _refresh(self, deadline: float, prefer: str = "") -> bool:
        """Ask members in random order (`prefer` first: the member that answered `moved`).
        The epoch held, confirmed by the first answer, is kept at once; a new epoch is taken
        when REFRESH_AGREE answers agree on it (a member with a stale view, such as one whose
        gossip is cut off, cannot move the client alone), or, when no more members answer in
        time, the epoch most answers gave (the first on a tie)."""
        with self._lock:
            known = [n.control for n in self._placement.serving
                     if n.control and not self._breaker.is_down(n.name)]  # fmt: skip
            since = self._epoch if self._rows else None
        seeds = list(self._seeds)
        random.shuffle(known)  # each refresh asks a random member: no member answers them all
        random.shuffle(seeds)
        votes: dict[Any, list[tuple[str, dict[str, Any]]]] = {}
        for url in list(dict.fromkeys([u for u in (prefer,) if u] + known + seeds))[:SEEDS_MAX]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                res = self._ask_members(url, since, min(self.deadline_s, left))
                epoch = res["epoch"] if "epoch" in res else None
            except (ControlError, OSError, ProtocolError, ValueError, KeyError, TypeError) as e:
                log.debug("kvcluster: members from %s: %s", url, e)
                continue  # that one did not answer, or answered nonsense: the next
            if epoch is None or (epoch == since and not votes):  # one agent; or no change
                return self._take(url, res)
            votes.setdefault(epoch, []).append((url, res))
            if len(votes[epoch]) >= REFRESH_AGREE:
                return self._take(*votes[epoch][-1])
        if votes:  # dict order is answer order: max() keeps the first of equal counts
            return self._take(*max(votes.values(), key=len)[-1])
        self._refreshed_at = time.monotonic()  # nobody answered: do not hammer the seeds
        return False

    def _take(self, url: str, res: dict[str, Any]) -> bool:
        try:
            self._apply(url, res)
        except (ValueError, KeyError, TypeError) as e:  # rows that make no placement
            log.warning("kvcluster: unusable member list from %s: %s", url, e)
            self._refreshed_at = time.monotonic()
            return False
        return True

    def _ask_members(self, url: str, since: int | None, timeout_s: float) -> dict[str, Any]:
        with ControlChannel(url, self._tenant, self._token, timeout_s=timeout_s,
                            client="kvcluster", ssl_context=self._ssl) as ch:  # fmt: skip
            ch.connect()
            if since is None:
                return ch.call("members")
            try:
                return ch.call("members", since=since)
            except ControlError as e:
                if isinstance(e, AgentUnreachable):
                    raise
            ch.connect()  # an agent without deltas refused the field (and may have hung up)
            return ch.call("members")  # the whole list

    def _apply(self, url: str, res: dict[str, Any]) -> None:
        """Take a `members` reply: the whole list, a delta against our epoch, or unchanged."""
        close: list[NodeClient] = []
        with self._lock:
            if res.get("unchanged"):
                rows = self._rows
                self.refresh_rows = 0
            elif "changed" in res:  # a delta against the epoch we sent
                rows = dict(self._rows)
                for name in res.get("removed") or []:
                    rows.pop(str(name), None)
                for r in res.get("changed") or []:
                    rows[str(r["name"])] = r
                self.refresh_rows = len(res.get("changed") or []) + len(res.get("removed") or [])
            else:
                listed = res.get("members") or []
                rows = {str(r["name"]): r for r in listed}
                self.refresh_rows = len(listed)
            if res.get("epoch") is None:  # one agent, not in cluster mode: it owns everything
                first = next(iter(rows), url)
                nodes = [Node(name=first, control=url)]
            else:
                nodes = [Node.from_dict(r) for r in rows.values() if r.get("status") == "alive"]
            placement = Placement(nodes)
            before = {n.name for n in self._placement.serving}
            if placement.epoch != self._placement.epoch and self._placement.serving:
                self._previous = self._placement  # reads fall back to it while chunks move
            self._rows = rows
            self._placement = placement
            self._epoch = res.get("epoch")
            self.replicas = max(1, min(REPLICAS_MAX, int(res.get("replicas") or 1)))
            self._refreshed_at = time.monotonic()
            self.refreshes.append((url, self.refresh_rows))
            live = {n.name: n for n in placement.serving}
            for name in [n for n in self._clients if n not in live]:
                close.append(self._clients.pop(name))
            for name in set(live) - before:  # (re)joined: the member list says it is back
                self._breaker.clear(name)
            for c in self._clients.values():
                assert isinstance(c._channel, EpochChannel)
                c._channel.epoch = self._epoch
        for c in close:  # off the call path: a gone member may not answer
            threading.Thread(target=c.abort, name="kvcluster-close", daemon=True).start()

    def _node(self, node: Node) -> NodeClient:
        with self._lock:  # no I/O here: building a client connects nothing
            c = self._clients.get(node.name)
            if c is not None and c.url == node.control:
                return c
            old = c
            c = self._node_client(node.control, self._tenant, self._token, self.layout, self._salt,
                           on_lost=functools.partial(self._tripped, node.name),
                           on_hot=self._mark_hot, **self._node_opts)  # fmt: skip
            ch = c._channel
            c._channel = EpochChannel(ch.url, ch.tenant, self._token, hostnqn=ch.hostnqn,
                                      timeout_s=ch.timeout_s,
                                      ssl_context=ch.ssl_context)  # fmt: skip
            c._channel.epoch = self._epoch
            self._clients[node.name] = c
        if old is not None:
            threading.Thread(target=old.abort, name="kvcluster-close", daemon=True).start()
        return c

    def _tripped(self, name: str, e: Exception) -> None:
        if self._breaker.trip(name):
            reason = e.message if isinstance(e, ControlError) else f"{type(e).__name__}: {e}"
            log.warning("kvcluster: member %s down (%s); skipped until a probe answers "
                        "(every %.1f s) or the member list changes", name, reason,
                        PROBE_INTERVAL_S)  # fmt: skip

    def _maintain(self) -> None:
        """Off the call path: refresh the member list when it is old, probe down members."""
        while not self._stop.is_set():
            self._wake.wait(MAINT_TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() - self._refreshed_at > self._refresh_every():
                    self.refresh(self.deadline_s * 2)
                for name in self._breaker.due():
                    with self._lock:
                        node = next((n for n in self._placement.serving if n.name == name), None)
                    if node is None:
                        self._breaker.clear(name)  # not a member any more: nothing to skip
                        continue
                    if self._node(node).probe() and self._breaker.clear(name):
                        log.warning("kvcluster: member %s answers again", name)
                        self._handoff(name)
            except Exception:  # the thread must outlive any one bad round
                log.exception("kvcluster: maintenance round failed")

    def _refresh_every(self) -> float:
        """How old a view may get: REFRESH_INTERVAL_S, or PROBE_INTERVAL_S while no seed or
        member has answered yet (calls serve misses meanwhile, without waiting)."""
        return REFRESH_INTERVAL_S if self._rows else PROBE_INTERVAL_S

    def _owners(self, keys: list[bytes]) -> tuple[list[Node], np.ndarray]:
        if not self._refreshed_at:
            self.refresh()  # the first call: nothing to route by without a view
        elif time.monotonic() - self._refreshed_at > self._refresh_every():
            self._wake.set()  # the maintenance thread refreshes; this call uses the view held
        with self._lock:
            p = self._placement
            now = time.monotonic()
            hot = (
                [i for i, k in enumerate(keys) if self._hot.get(k, 0.0) > now] if self._hot else []
            )
        owners = p.owner_index(keys64(keys), self.replicas)
        if hot and len(p.serving) > owners.shape[1]:
            wide = p.owner_index(keys64([keys[i] for i in hot]), self.replicas + HOT_EXTRA_REPLICAS)
            out = np.full((len(keys), wide.shape[1]), -1, dtype=np.int64)
            out[:, : owners.shape[1]] = owners
            shift = self._rng.integers(0, wide.shape[1], size=len(hot))
            for j, i in enumerate(hot):  # a random copy first: reads spread over all of them
                out[i] = np.roll(wide[j], -int(shift[j]))
            owners = out
        return list(p.serving), owners

    def _mark_hot(self, keys: list[bytes]) -> None:
        """An owner said these keys are hot: read them from any of their copies for a while."""
        if not self.spread_hot_reads:
            return
        until = time.monotonic() + HOT_TTL_S
        with self._lock:
            for key in keys:
                self._hot[key] = until
            if len(self._hot) > HOT_TRACK_MAX:
                now = time.monotonic()
                self._hot = {k: t for k, t in self._hot.items() if t > now}

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
    def _by_owner(self, keys: list[bytes], call: _Call) -> list[Any]:
        """Ask each key's owners, rank by rank, for the keys still unanswered. `call(node,
        client, idxs)` answers how many leading keys of `idxs` it served (or their lengths);
        returns per key what the serving replica answered (None: no replica)."""
        for attempt in range(MOVED_RETRIES_MAX + 1):
            try:
                return self._ranks(keys, call)
            except _Moved as m:
                self._moved(attempt, m)
        return [None] * len(keys)

    def _moved(self, attempt: int, moved: _Moved) -> None:
        """A member answered `moved`: its view differs from ours; ask it first."""
        self.moved_count += 1
        name = moved.args[0] if moved.args else ""
        with self._lock:
            url = next((n.control for n in self._placement.serving if n.name == name), "")
        self.refresh(self.deadline_s, prefer=url)
        if attempt == MOVED_RETRIES_MAX:
            log.warning("kvcluster: members keep moving; serving misses this call")

    def _ranks(self, keys: list[bytes], call: _Call) -> list[Any]:
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
        call: _Call,
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

    def _one(self, node: Node, idxs: list[int], call: _Call) -> Any:
        if self._breaker.is_down(node.name):
            return 0  # skipped: a miss at once, the next replica is asked
        try:
            return call(node, self._node(node), idxs)
        except ControlError as e:
            if e.code == "moved":
                raise _Moved(node.name) from None
            if isinstance(e, AgentUnreachable):
                return 0
            if e.code in MISS_CODES:  # this member refuses (a tenant change not there yet, a
                # cut-off node refusing writes): a miss here, the next replica is asked
                if (node.name, e.code) not in self._refusals_logged:  # once per member
                    self._refusals_logged.add((node.name, e.code))
                    log.warning("kvcluster: member %s refused (%s: %s); counted as a miss",
                                node.name, e.code, e.message)  # fmt: skip
                return 0
            raise

    # --- key-level calls -----------------------------------------------------------------
    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
        keys = _checked(keys)
        if not keys:
            return []
        got = self._by_owner(keys, lambda _, c, idxs: c.lookup_lengths([keys[i] for i in idxs]))
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

        def read(_: Node, c: NodeClient, idxs: list[int]) -> int:
            return c.get_keys([keys[i] for i in idxs], [into[i] for i in idxs],
                              chunk_bytes=chunk_bytes)  # fmt: skip

        return len(_prefix(self._by_owner(keys, read)))

    def put_keys(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> int:
        """Writes go to every owner that is not down, at once; a chunk counts as stored when
        one replica committed it (docs/CLUSTER.md, "What a write acknowledges")."""
        keys = _checked(keys)
        if parents is None:
            parents = [None, *keys[:-1]]
        elif len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys: give one per key")
        keys = keys[: len(chunks)]
        if not keys:
            return 0
        stored = [False] * len(keys)
        put = _putter(keys, chunks, parents, chunk_bytes)
        for attempt in range(MOVED_RETRIES_MAX + 1):
            try:
                nodes, owners = self._owners(keys)
                jobs = []
                for rank in range(owners.shape[1]):  # every replica, all ranks at once
                    groups: dict[int, list[int]] = {}
                    for i in range(len(keys)):
                        if owners[i, rank] >= 0:  # -1: fewer owners (hot keys have more)
                            groups.setdefault(int(owners[i, rank]), []).append(i)
                    jobs += [
                        (nodes[n].name, idxs, self._pool.submit(self._one, nodes[n], idxs, put))
                        for n, idxs in groups.items()
                    ]
                results = _settle({j: (name, fut) for j, (name, _, fut) in enumerate(jobs)})
                missed: list[tuple[str, int]] = []
                for (name, idxs, _), took in zip(jobs, results.values(), strict=True):
                    for i in idxs[:took]:
                        stored[i] = True
                    if took < len(idxs) and self._breaker.is_down(name):
                        missed += [(name, i) for i in idxs[took:]]
                self._hint(missed, keys, chunks, parents, chunk_bytes, stored)
                break
            except _Moved as m:
                self._moved(attempt, m)
        return len(_prefix([True if s else None for s in stored]))

    def _hint(
        self, missed: list[tuple[str, int]], keys: list[bytes], chunks: Sequence[Any],
        parents: Sequence[bytes | None], chunk_bytes: int | None, stored: list[bool],
    ) -> None:  # fmt: skip
        """Remember the copies a down replica missed (hinted handoff): when a probe finds it
        back, the maintenance thread copies each chunk from a replica that has it."""
        with self._lock:
            for name, i in missed:
                if not stored[i]:
                    continue  # no replica has it: nothing to copy from
                self._delete_hints.pop((name, keys[i]), None)  # written again since
                nbytes = _nbytes(chunks[i]) if chunk_bytes is None else chunk_bytes
                self._hints[(name, keys[i])] = (nbytes, parents[i])
                self._hints.move_to_end((name, keys[i]))
                while len(self._hints) > HINTS_MAX:
                    self._hints.popitem(last=False)
                    self.hints_dropped += 1

    def _handoff(self, name: str) -> None:
        """Copy the chunks `name` missed while it was down from the replicas that have them;
        then replay the deletes it missed (on every owner: its anti-entropy may have copied
        the chunk back to them already)."""
        with self._lock:
            todo = [(k, v) for (n, k), v in self._hints.items() if n == name]
            deletes = [k for (n, k) in self._delete_hints if n == name]
            node = next((m for m in self._placement.serving if m.name == name), None)
        for key, (nbytes, parent) in todo:
            if node is None or self._breaker.is_down(name) or self._stop.is_set():
                return
            buf = bytearray(nbytes)
            copied = False
            try:
                if self._node(node).lookup_keys([key]) == 1:
                    pass  # it has it after all (it stored it before it went silent)
                elif self.get_keys([key], [buf], chunk_bytes=nbytes) == 1:
                    copied = self._node(node).put_keys([key], [buf], [parent],
                                                       chunk_bytes=nbytes) == 1  # fmt: skip
            except (ControlError, ValueError) as e:
                log.debug("kvcluster: handoff of %s to %s: %s", key.hex(), name, e)
            with self._lock:
                self._hints.pop((name, key), None)
            self.hints_replayed += copied
        if deletes and node is not None and not self._breaker.is_down(name):
            try:
                for i in range(0, len(deletes), LOOKUP_KEYS_MAX):
                    part = deletes[i : i + LOOKUP_KEYS_MAX]
                    self._node(node).deleted(part)
                    self.delete_keys(part, hint=False)
            except (ControlError, ValueError) as e:
                log.debug("kvcluster: replaying deletes on %s: %s", name, e)
                return  # the hints stay: the next probe that finds it back tries again
            with self._lock:
                for key in deletes:
                    self._delete_hints.pop((name, key), None)

    def lease_keys(self, keys: list[bytes]) -> tuple[int, int]:
        """Each owner leases its part of the prefix; one cluster lease id names them all."""
        keys = _checked(keys)
        if not keys:
            return 0, 0
        held: list[tuple[str, int]] = []

        def lease(node: Node, c: NodeClient, idxs: list[int]) -> int:
            n, lease_id = c.lease_keys([keys[i] for i in idxs])
            if lease_id:
                held.append((node.name, lease_id))  # list.append: atomic across pool threads
            return n

        hits = len(_prefix(self._by_owner(keys, lease)))
        if not held:
            return hits, 0
        if not hits:
            self._release(held)
            return 0, 0
        with self._lock:
            lease_id = self._next_lease
            self._next_lease = 1 if lease_id >= (1 << 62) else lease_id + 1
            self._leases[lease_id] = held
            while len(self._leases) > LEASES_MAX:
                self._leases.popitem(last=False)  # lapses at the agents' lease TTL
        return hits, lease_id

    def release_lease(self, lease_id: int) -> None:
        with self._lock:
            held = self._leases.pop(lease_id, None) if lease_id else None
        if held:
            self._release(held)

    def _release(self, held: list[tuple[str, int]]) -> None:
        for name, node_lease in held:
            with self._lock:
                c = self._clients.get(name)
            if c is not None and not self._breaker.is_down(name):
                c.release_lease(node_lease)  # posted: no round trip

    def delete_keys(self, keys: list[bytes], *, hint: bool = True) -> int:
        """Delete on every owner; an owner that is down or does not answer gets the delete
        when a probe finds it back (`hint`: remember it; False for a replay)."""
        keys = _checked(keys)
        if not keys:
            return 0
        nodes, owners = self._owners(keys)
        groups: dict[int, list[int]] = {}
        for i in range(len(keys)):
            for n in owners[i]:
                if n >= 0:
                    groups.setdefault(int(n), []).append(i)
        jobs = {n: self._pool.submit(self._one, nodes[n], idxs,
                                     lambda _, c, ix: c.deleted([keys[i] for i in ix]))
                for n, idxs in groups.items()}  # fmt: skip
        found = [False] * len(keys)
        for n, flags in _settle(jobs).items():
            # skipped as down (0), or lost during the call (all False, then marked down)
            if not isinstance(flags, list) or self._breaker.is_down(nodes[n].name):
                if hint:
                    self._hint_deletes(nodes[n].name, [keys[i] for i in groups[n]])
                if not isinstance(flags, list):
                    continue
            for i, flag in zip(groups[n], flags, strict=False):
                found[i] |= bool(flag)
        return sum(found)

    def _hint_deletes(self, name: str, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._hints.pop((name, key), None)  # a copy to hand over no more
                self._delete_hints[(name, key)] = None
                self._delete_hints.move_to_end((name, key))
            while len(self._delete_hints) > HINTS_MAX:
                self._delete_hints.popitem(last=False)
                self.hints_dropped += 1

    @property
    def transport(self) -> str:
        with self._lock:
            used = [c.transport for c in self._clients.values() if c.transport]
        if used:
            return used[0]
        return "nvme-tcp" if self._wanted_transport == "nvme-tcp" else ""

    @property
    def channel(self) -> ControlChannel:
        """The control channel of a member that answers (stats, members, raw calls)."""
        nodes, _ = self._owners([])
        for node in nodes:
            if not self._breaker.is_down(node.name):
                try:
                    return self._node(node).channel
                except AgentUnreachable:
                    continue
        raise AgentUnreachable(f"no member of {','.join(self._seeds)} answers")

    def stats(self) -> dict[str, Any]:
        """The router's state and each member's stats for the tenant (asked in parallel)."""
        nodes, _ = self._owners([])
        jobs = {n.name: self._pool.submit(self._node_stats, n) for n in nodes}
        return {
            "epoch": self._epoch, "replicas": self.replicas, "moved": self.moved_count,
            "down": self.down(), "breaker_trips": self._breaker.trips,
            "hints": len(self._hints) + len(self._delete_hints),
            "hints_replayed": self.hints_replayed,
            "hints_dropped": self.hints_dropped,
            "refreshes": list(self.refreshes),
            "nodes": {name: f.result() for name, f in jobs.items()},
        }  # fmt: skip

    def _node_stats(self, node: Node) -> dict[str, Any]:
        if self._breaker.is_down(node.name):
            return {"error": "down"}
        try:
            return self._node(node).stats()
        except ControlError as e:
            return {"error": e.message}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._maint.join(timeout=self.deadline_s * 4 + 1)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._closed:
                return
            clients = list(self._clients.items())
            self._clients.clear()
            self._closed = True
        for name, c in clients:  # a down member's client is aborted: nothing waits on it
            if self._breaker.is_down(name):
                c.abort()
            else:
                c.close()


_Call = Callable[[Node, "NodeClient", list[int]], Any]


def _putter(
    keys: list[bytes], chunks: Sequence[Any], parents: Sequence[bytes | None],
    chunk_bytes: int | None,
) -> _Call:  # fmt: skip
    def put(_: Node, c: NodeClient, idxs: list[int]) -> int:
        return c.put_keys([keys[i] for i in idxs], [chunks[i] for i in idxs],
                          [parents[i] for i in idxs], chunk_bytes=chunk_bytes)  # fmt: skip

    return put


def _settle(jobs: dict[Any, Any]) -> dict[Any, Any]:
    """Every job's result once all have finished (none may still touch a caller's buffer);
    _Moved if any node answered moved."""
    results: dict[Any, Any] = {}
    moved: _Moved | None = None
    for name, job in jobs.items():
        fut = job[1] if isinstance(job, tuple) else job
        try:
            results[name] = fut.result()
        except _Moved as m:
            moved = moved or m
    if moved is not None:
        raise moved  # names the first member that answered moved
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
