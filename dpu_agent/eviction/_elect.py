"""`elect`: a leader among a few candidate policies, chosen online by sampled shadows.

- **The leader** is one full instance of a candidate; it alone orders the tier's items. It
  starts as `prefix-run`, the candidate robust across shapes (docs/EVICTION.md).
- **Shadows** (SHARDS: Waldspurger et al., FAST 2015): one miniature cache per candidate, the
  leader's included, fed only the items whose key hash falls in a sample of rate R = 2^-shift
  and holding R x the items the tier holds. The hash is of the item, which the engine derives
  from the chunk's key, so a chunk evicted and put again is the same sample member. A sampled
  block hits in a shadow when it is cached there and its nearest sampled ancestor hit in the
  same request (prefix hits, as the tier counts them). The rate is 1 while the cache is young
  (a cold tier decides on everything it sees), then at most 2^-`SAMPLE_SHIFT_STEADY` (what
  bounds the shadows' CPU), lower still when a shadow would hold more than `SHADOW_ITEMS_MAX` (what
  bounds their memory), never so low that a shadow holds fewer than `SHADOW_ITEMS_MIN` (below
  that the sample says nothing).
- **The election** is a sequential paired test: per request, each shadow's hits; a challenger
  takes over when the sum of its per-request lead over the leader is at least `SWITCH_Z`
  standard errors (the sum over the square root of the sum of squares) and at least
  `SWITCH_MARGIN` of the sampled references. Both are scale-free: no count of turnovers or
  requests, so a clear lead switches early on a young cache and a faint one never does. Sums
  halve every `HALF_LIFE_TURNOVERS` shadow turnovers, no sooner than every
  `HALF_LIFE_REQUESTS` scored requests (a workload that changes shape is followed); at a
  switch the evidence involving the new leader starts again from zero.
- **A switch flushes nothing**: a new instance of the winner adopts the tier's items
  (`EvictionPolicy.adopt`, in the old leader's eviction order), so the next victim is the new
  leader's choice among the same items. Adoption is O(n log n) for n items held, so switches
  are at least one turnover of the tier apart: O(log n) per access, amortised.

Memory: the leader, a parent per item held (adoption needs the prefix tree whatever the
leader was) and the shadows' fixed budget.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from dpu_agent.eviction._lru import Lru2Policy, LruPolicy
from dpu_agent.eviction._policy import Evictable, EvictionPolicy, Ordering, Resident
from dpu_agent.eviction._prefix import PrefixPolicy
from dpu_agent.eviction._prefix_run import RunAwarePrefixPolicy
from dpu_agent.eviction._s3fifo import S3FifoPolicy

__all__ = ["CANDIDATES", "ElectPolicy"]

# What `elect` can lead with: the policies that can hand a tier over (`resident()`).
_CANDIDATE_FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "prefix-run": RunAwarePrefixPolicy,
    "prefix": PrefixPolicy,
    "s3fifo": S3FifoPolicy,
    "lru": LruPolicy,
    "lru2": Lru2Policy,
}
# The default candidates, the first the starting leader. `prefix-run` is the best fixed policy
# or near it on most cells; `prefix` (no run penalty) wins large caches of conversations, whose
# first turns come back after long gaps; `s3fifo` wins tiny caches (docs/EVICTION.md). Each more
# candidate costs a shadow's CPU and memory.
CANDIDATES: tuple[str, ...] = ("prefix-run", "prefix", "s3fifo")
SHADOW_ITEMS_MAX = 2048  # items per shadow at most: the shadows' memory does not grow past it
# ... and at least this many: the rate stays higher where the tier is smaller. 32 and 1/8 chose
# the same leaders as 64 and 1/4 on the development traces (mean gap -0.251 against -0.246
# points) for about half the shadows' CPU (docs/EVICTION.md, "elect")
SHADOW_ITEMS_MIN = 32
SAMPLE_SHIFT_STEADY = 3  # R <= 1/8 once the cache is not young
SAMPLE_SHIFT_MAX = 24  # the sample hash has 24 bits
# young: fewer operations than four times the items held. On the development data (seeds 0, 1,
# 726997 and Mooncake, 256 cells) 4 left 4 cells under LRU, 2 and 3 left 5 (the `conv` cells at
# 10%, where the steady sample misses `prefix`'s and LRU's lead); a young tier samples at up to
# 1/2, and the cost bench's DRAM tier, young throughout, costs 1.84-1.88x `prefix-run`'s CPU
# (docs/EVICTION.md, "Youth and a fourth candidate")
YOUNG_TURNOVERS = 4.0
# standard errors of the per-request lead, tested after every request: 2.0 switched on noise
# (mix, restarting, at 5%), 3.0 switched too late (conv, restarting, at 10%)
SWITCH_Z = 2.5
SWITCH_MARGIN = 0.005  # of the sampled references: half a point, the bar's indifference
HALF_LIFE_TURNOVERS = 8.0  # evidence halves every 8 shadow turnovers of sampled references
HALF_LIFE_REQUESTS = 512  # ... and no sooner than 512 scored requests: a small cache turns
# over within a request or two, and a few requests are too little evidence to decide anything
SWITCH_GAP_TURNOVERS = 1.0  # tier turnovers (operations / items held) between two switches
# The most items a switch hands over: a switch runs inside a put or a lookup, under the
# engine lock, and adopting is Python work (about 8 us an item: a switch of a 1M-item tier
# stalled every tenant 3.1-4.9 s). A tier holding more hands over nothing: the new leader starts
# empty, the old one keeps its items and evicts them first, in its own order, until it is
# empty (a turnover at most), and one used again joins the new leader. Every tier of the
# family's cells and of the Mooncake trace is far smaller (their hits are the same); what the
# bound costs in hits where a tier is larger, and the largest stall (a handover of this many),
# are in docs/EVICTION.md, "A switch's handover, bounded", and `dpuctl bench recovery`.
SWITCH_ADOPT_MAX = 32768
# Ancestors walked to find a sampled one: 2^12 is 256 x the expected walk at the lowest
# steady rate (1/8) and 2 MB of 512-token chunks of one prefix; a longer walk means a loop.
ANCESTORS_MAX = 4096
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits mix every id bit
_MASK64 = (1 << 64) - 1


def _sample_hash(item: int) -> int:
    return ((item * _HASH_MULTIPLIER) & _MASK64) >> 40


class _Shadow:
    """One candidate's miniature cache over the sampled items, and its hits in this request."""

    __slots__ = ("items", "name", "policy", "request_hits", "scored")

    def __init__(self, name: str, hint: int) -> None:
        self.name = name
        self.policy = _CANDIDATE_FACTORIES[name](hint)
        self.items: dict[int, int | None] = {}  # item -> its parent in the shadow
        self.request_hits = 0
        self.scored: dict[int, bool] = {}  # sampled item -> prefix hit, in this request

    def reference(self, item: int, up: int | None, now: float, room: int) -> None:
        cached = item in self.items
        hit = cached and (up is None or self.scored.get(up, True))
        self.scored[item] = hit
        if hit:
            self.request_hits += 1
        if cached:
            self.policy.access(item, now)
            return
        while len(self.items) >= room:
            # the engine's rule: a put never evicts the chunk it extends
            victim = self.policy.victim(partial(operator.ne, up))
            if victim is None:
                return
            self.policy.remove(victim)
            del self.items[victim]
        parent = up if up in self.items else None
        self.policy.insert(item, parent, now)
        self.items[item] = parent

    def resample(self, keep: Callable[[int], bool], hint: int, now: float) -> None:
        """Keep only the items `keep` says are still sampled, in a policy sized by `hint`."""
        kept = [(i, u) for i, u in self.policy.resident() if keep(i)]
        items = {i: self.items[i] for i, _ in kept}
        self.items = {i: (p if p in items else None) for i, p in items.items()}
        self.policy = _CANDIDATE_FACTORIES[self.name](hint)
        self.policy.adopt([(i, self.items[i], u) for i, u in kept], now)
        self.scored.clear()


class ElectPolicy(EvictionPolicy):
    """Victims from the candidate whose sampled shadow leads the others by clear evidence."""

    name = "elect"

    def __init__(
        self,
        capacity: int,
        *,
        candidates: Sequence[str] = CANDIDATES,
        shadow_items_max: int = SHADOW_ITEMS_MAX,
        shadow_items_min: int = SHADOW_ITEMS_MIN,
        sample_shift_steady: int = SAMPLE_SHIFT_STEADY,
        young_turnovers: float = YOUNG_TURNOVERS,
        switch_z: float = SWITCH_Z,
        switch_margin: float = SWITCH_MARGIN,
        half_life_turnovers: float = HALF_LIFE_TURNOVERS,
        half_life_requests: int = HALF_LIFE_REQUESTS,
        switch_gap_turnovers: float = SWITCH_GAP_TURNOVERS,
        switch_adopt_max: int = SWITCH_ADOPT_MAX,
    ) -> None:
        super().__init__(capacity)
        assert candidates and set(candidates) <= set(_CANDIDATE_FACTORIES), candidates
        assert 0 < shadow_items_min <= shadow_items_max, (shadow_items_min, shadow_items_max)
        assert 0 <= sample_shift_steady <= SAMPLE_SHIFT_MAX, sample_shift_steady
        assert switch_z > 0 and switch_margin >= 0 and half_life_turnovers > 0
        assert switch_adopt_max > 0, switch_adopt_max
        self._names = tuple(candidates)
        self._leader = 0
        self._policy = _CANDIDATE_FACTORIES[self._names[0]](capacity)
        # former leaders still holding the items a switch did not hand over, oldest first:
        # evicted from before the leader's, each dropped once empty
        self._draining: list[EvictionPolicy] = []
        self._adopt_max = switch_adopt_max
        self._shadows = [_Shadow(n, capacity) for n in self._names]
        self._parent: dict[int, int | None] = {}  # every item held -> its held parent
        self._up: dict[int, int | None] = {}  # sampled items held -> nearest sampled ancestor
        self._items_max = shadow_items_max
        self._items_min = shadow_items_min
        self._shift_steady = sample_shift_steady
        self._young = young_turnovers
        self._z2 = switch_z * switch_z
        self._margin = switch_margin
        self._half_life = half_life_turnovers
        self._half_life_requests = half_life_requests
        self._gap = switch_gap_turnovers
        self._shift = 0
        self._grown = False  # no longer young
        self._held_max = 0
        self._ops = 0
        self._switched_at = 0  # self._ops at the last switch
        self._now: float | None = None
        self._scoring = False  # the current request had a sampled reference
        n = len(self._names)
        # decayed sums over requests of (hits of shadow i - hits of shadow j), and of squares
        self._lead = [[0.0] * n for _ in range(n)]
        self._lead_sq = [[0.0] * n for _ in range(n)]
        self._refs = 0.0  # decayed sampled references
        self._refs_since_decay = 0
        self._requests_since_decay = 0
        self.switches = 0
        self.sampled_references = 0  # references the shadows were fed

    @property
    def leader(self) -> str:
        return self._names[self._leader]

    @property
    def sample_rate(self) -> float:
        return 2.0**-self._shift

    def sampled(self, item: int) -> bool:
        """Whether the shadows follow `item`: a function of the item (its key) and the rate."""
        return self._sampled(item)

    def shadow_items(self) -> int:
        """Items held by all the shadows together."""
        return sum(len(s.items) for s in self._shadows)

    # --- the tier's calls ------------------------------------------------------------------

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self._parent, item
        self._ops += 1
        self._policy.insert(item, parent, now)
        parents = self._parent
        if parent is not None and parent not in parents:
            parent = None
        parents[item] = parent
        if len(parents) > self._held_max:
            self._held_max = len(parents)
            if self._held_max >> self._shift > self._items_max:
                self._resample(now)
        if not self._grown and self._ops >= self._young * self._held_max:
            self._grown = True
            self._resample(now)
        if self._sampled(item):
            up = self._nearest(item)
            self._up[item] = up
            self._reference(item, up, now)

    def access(self, item: int, now: float) -> None:
        self._ops += 1
        if self._draining and self._leave_draining(item):  # used again: it joins the leader
            parent = self._parent[item]
            self._policy.insert(item, parent if parent in self._policy else None, now)
        self._policy.access(item, now)
        if item in self._up:
            self._reference(item, self._up[item], now)

    def adopt(self, items: Sequence[Resident], now: float) -> None:
        """Take a tier over (a restart's saved order): the leader adopts it; the shadows and
        the evidence start empty, as at `restore`, and nothing is scored. (Shadows seeded
        with the adopted contents were tried: adoption is not history, and on `agent` at 5%
        the seeded `s3fifo` shadow led the others within four turnovers and took the tier,
        49.8% of the second half hit against 55.4% with empty shadows, research/restart_warm.py.)"""
        assert not self._parent, len(self._parent)
        self._draining = []  # held nothing: nothing to drain
        self._policy.adopt(items, now)
        held = {item for item, _, _ in items}  # a parent comes after its children in `items`
        parents = self._parent
        for item, parent, _ in items:
            parents[item] = parent if parent in held else None
        self._held_max = max(self._held_max, len(parents))
        if self._held_max >> self._shift > self._items_max:
            self._resample(now)  # the sampling rate for this size
        self._up = {i: self._nearest(i) for i in parents if self._sampled(i)}
        self._now = None

    def remove(self, item: int) -> None:
        if not (self._draining and self._leave_draining(item)):
            self._policy.remove(item)
        del self._parent[item]
        self._up.pop(item, None)

    def victim(self, evictable: Evictable) -> int | None:
        for old in self._draining:  # what a switch did not hand over goes first
            chosen = old.victim(evictable)
            if chosen is not None:
                return chosen
        return self._policy.victim(evictable)

    def _leave_draining(self, item: int) -> bool:
        """Take `item` out of the former leader holding it; False if none does."""
        for k, old in enumerate(self._draining):
            if item in old:
                old.remove(item)
                if not len(old):
                    del self._draining[k]
                return True
        return False

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, item: object) -> bool:
        return item in self._parent

    def resident_later(self, limit: int | None = None) -> Ordering:
        if not self._draining:
            return self._policy.resident_later(limit)
        # the draining former leaders' items go first (oldest leader first), then the leader's
        parts = [self._policy.resident_later(limit)]
        left = None if limit is None else limit - len(self._policy)
        for old in reversed(self._draining):
            if left is not None and left <= 0:
                break
            parts.append(old.resident_later(left))
            left = None if left is None else left - len(old)
        parts.reverse()
        return lambda: [entry for later in parts for entry in later()]

    def state(self) -> dict[str, Any]:
        """The leader: a restarted tier begins with it rather than with the prior."""
        return {"leader": self.leader}

    def restore(self, state: Mapping[str, Any], now: float) -> None:
        """Lead with the candidate an earlier run of this tier had elected (its items, if
        recovery brought any back, adopted as at a switch); the shadows and the evidence start
        empty, so it is challenged like any leader. An unknown name changes nothing."""
        name = state.get("leader")
        if not isinstance(name, str) or name not in self._names:
            return
        leader = self._names.index(name)
        if leader != self._leader:
            self._lead_with(leader, now, adopt_max=None)  # before serving: all of it

    # --- the shadows and the election ------------------------------------------------------

    def _sampled(self, item: int) -> bool:
        return not _sample_hash(item) & ((1 << self._shift) - 1)

    def _room(self) -> int:
        return max(1, self._held_max >> self._shift)

    def _reference(self, item: int, up: int | None, now: float) -> None:
        if now != self._now:
            self._end_request()
            self._now = now
        self._scoring = True
        room = self._room()
        for s in self._shadows:
            s.reference(item, up, now, room)
        self._refs += 1.0
        self._refs_since_decay += 1
        self.sampled_references += 1

    def _end_request(self) -> None:
        if not self._scoring:
            return
        self._scoring = False
        hits = [s.request_hits for s in self._shadows]
        for i, hi in enumerate(hits):
            row, sq = self._lead[i], self._lead_sq[i]
            for j, hj in enumerate(hits):
                d = hi - hj
                row[j] += d
                sq[j] += d * d
        for s in self._shadows:
            s.request_hits = 0
            s.scored.clear()
        self._requests_since_decay += 1
        if (
            self._refs_since_decay >= self._half_life * self._room()
            and self._requests_since_decay >= self._half_life_requests
        ):
            self._refs_since_decay = self._requests_since_decay = 0
            self._refs /= 2.0
            for rows in (self._lead, self._lead_sq):
                for row in rows:
                    row[:] = [v / 2.0 for v in row]
        self._elect()

    def _elect(self) -> None:
        if self._ops - self._switched_at < self._gap * self._held_max:
            return
        lead = self._leader
        best = max(range(len(self._names)), key=lambda i: self._lead[i][lead])
        margin = self._lead[best][lead]
        if best == lead or margin <= self._margin * self._refs:
            return
        if margin * margin >= self._z2 * self._lead_sq[best][lead]:
            self._switch_to(best)

    def _lead_with(self, leader: int, now: float, adopt_max: int | None) -> None:
        """A new instance of candidate `leader` takes the tier over. If the old leader holds
        at most `adopt_max` items (or `adopt_max` is None) the new one adopts them all, in the
        old leader's order (nothing flushed); otherwise it starts empty and the old leader
        keeps its items and evicts them first (`_draining`): O(1), whatever the tier holds."""
        new = _CANDIDATE_FACTORIES[self._names[leader]](self.capacity)
        old, parents = self._policy, self._parent
        if adopt_max is not None and len(old) > adopt_max:
            self._draining.append(old)
        else:
            new.adopt([(i, parents[i], used) for i, used in old.resident()], now)
        self._policy = new
        self._leader = leader

    def _switch_to(self, leader: int) -> None:
        assert self._now is not None
        self._lead_with(leader, self._now, self._adopt_max)
        self._switched_at = self._ops
        self.switches += 1
        for rows in (self._lead, self._lead_sq):  # the new leader's evidence starts again
            rows[leader][:] = [0.0] * len(rows[leader])
            for row in rows:
                row[leader] = 0.0

    def _resample(self, now: float) -> None:
        """The sampling rate for the tier's size and age: lower it (never raise it: the items
        dropped from the sample are gone) and drop the items no longer sampled."""
        shift = 0
        if self._grown:
            while shift < self._shift_steady and self._held_max >> (shift + 1) >= self._items_min:
                shift += 1
        while self._held_max >> shift > self._items_max and shift < SAMPLE_SHIFT_MAX:
            shift += 1
        if shift <= self._shift:
            return
        self._shift = shift
        self._end_request()  # score what the old sample saw
        hint = max(1, self.capacity >> shift)
        for s in self._shadows:
            s.resample(self._sampled, hint, now)
        # Items sampled at the lower rate were sampled at the old one, so `_up`'s keys (the
        # held items sampled; at most about 2 x SHADOW_ITEMS_MAX) hold them all: a walk over
        # every held item instead stalled the tier's lock 25 ms at 131k items, 0.2 s at 1M
        self._up = {i: self._nearest(i) for i in self._up if self._sampled(i)}
        self._now = None

    def _nearest(self, item: int) -> int | None:
        """The nearest sampled ancestor held, None if there is none. A parent link outlives a
        parent that left and came back under another parent, so links can loop (a client
        that puts A under B, then B under A): the walk gives up after `ANCESTORS_MAX` steps."""
        parents = self._parent
        up = parents[item]
        for _ in range(ANCESTORS_MAX):
            if up is None or self._sampled(up):
                return up
            up = parents.get(up)
        return None

    def __repr__(self) -> str:  # test failures and debugging name the leader
        return (
            f"ElectPolicy(leader={self.leader}, switches={self.switches}, "
            f"rate=1/{1 << self._shift}, held={len(self)})"
        )
