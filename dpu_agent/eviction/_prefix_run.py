"""`prefix-run`: `prefix` plus a next-use prediction for new blocks from the run they sit in.

A block's *run* is the number of blocks of its request missed in a row up to and including
it. A never-seen block deep in a run (run > `run_blocks_max`) belongs to a prompt that shares
nothing beyond its start with anything cached: a one-off document, a new long context. Such
blocks come back late if at all (Mooncake trace: of the new blocks, 2.6% are reused within 50
requests). A block that extends a reused prefix by a few blocks is the newest turn of a
conversation or an agent step, and the next turn reuses it soon. So a never-seen block deep in
a run enters probation as if it had been last used `run_penalty_turnovers` cache turnovers ago
(turnover = the items held, in operations): it goes before the fresh tails of conversations,
and a later hit makes it an ordinary protected item. A new prompt's first `run_blocks_max`
blocks are unaffected, so a document read twice in a row still hits.

How much the penalty weighs is learnt, as ARC learns its split (Megiddo and Modha): a penalised
block evicted before any hit goes to a ghost list of its own. If it comes back while that
ghost list still remembers it, the penalty cost a hit the cache could have had, and the weight
falls; when a block evicted without the penalty (ARC's ghost lists) comes back, the cache
lacked room that penalised blocks took, and the weight rises. The steps are ARC's (one over the
items held, scaled by the ratio of the ghost lists' sizes), so the rule has no parameter of its
own. Conversations whose long first turn comes back after a gap the cache can span (a large
cache of the `conv` shape) drive the weight to 0, which is `prefix`; one-off documents that
never come back leave it at 1, the fixed penalty. It starts at 1 (a cold tier is `prefix-run`
as it was chosen).

Recency is measured in operations (inserts plus accesses), not in seconds: the penalty is a
number of turnovers, which an operation count measures whatever the request rate. Operations
that share `now` (the blocks of one request) share the clock reading of the first of them, so
ties still go to the deeper block as in `prefix`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dpu_agent.eviction._policy import Resident
from dpu_agent.eviction._prefix import PrefixPolicy

__all__ = ["RunAwarePrefixPolicy"]

# probation's starting share: S3-FIFO's 10%, as `prefix-run` was chosen (the penalty already
# clears deep runs out of probation; 25%, `prefix`'s, did no better on the development data)
PROBATION_START = 0.1
RUN_BLOCKS_MAX = 4  # a conversation turn or agent step adds a few blocks; documents add tens
RUN_PENALTY_TURNOVERS = 4.0  # ahead of any fresh tail, at full weight (the weight is learnt)
SKETCH_COUNTERS_PER_ITEM = 16
SKETCH_AGING_FACTOR = 10
SKETCH_COUNT_MAX = 15
# odd 64-bit constants (golden ratio, xxHash primes): one per row, four rows (`add` is
# written out for four: it runs on every put and use, and a loop over rows cost it 2x)
_M0, _M1, _M2, _M3 = _HASH_MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x27D4EB2F165667C5,
)
SKETCH_ROWS = len(_HASH_MULTIPLIERS)


class RunAwarePrefixPolicy(PrefixPolicy):
    """`prefix` whose new blocks deep in a run of misses enter probation already old."""

    name = "prefix-run"

    def __init__(
        self,
        capacity: int,
        *,
        run_blocks_max: int = RUN_BLOCKS_MAX,
        run_penalty_turnovers: float = RUN_PENALTY_TURNOVERS,
    ) -> None:
        super().__init__(capacity, probation_fraction=PROBATION_START)
        assert run_blocks_max >= 0, run_blocks_max
        assert run_penalty_turnovers >= 0.0, run_penalty_turnovers
        self._run_blocks_max = run_blocks_max
        self._run_penalty_turnovers = run_penalty_turnovers
        self._ops = 0
        self._clock = 0.0  # self._ops when `now` last changed
        self._now: float | None = None
        self._seen = _SeenSketch()
        self._adopting = False
        self._weight = 1.0  # of the penalty, in 0..1: learnt from the ghost lists (above)
        # penalised blocks evicted before any hit, at most as many as the items held
        self._cold_ghosts: OrderedDict[int, None] = OrderedDict()

    @property
    def penalty_weight(self) -> float:
        """How much of the run penalty new blocks get now (1: all of it, 0: none: `prefix`)."""
        return self._weight

    def adopt(self, items: Sequence[Resident], now: float) -> None:
        # Adopted items are not new: none enters already old for sitting deep in a run.
        self._adopting = True
        try:
            super().adopt(items, now)
        finally:
            self._adopting = False

    def insert(self, item: int, parent: int | None, now: float) -> None:
        self._tick(now)
        self._learn(item)  # before the insert below consumes the ghost entry
        pnode = self._nodes.get(parent) if parent is not None else None
        # A parent still in probation was missed in this request too (a hit protects it).
        parent_run = pnode.run if pnode is not None and not pnode.protected else 0
        held = min(len(self._nodes) + 1, self.capacity)
        seen = self._seen.add(item, held)
        run = parent_run + 1
        last = self._clock
        penalised = not seen and run > self._run_blocks_max and not self._adopting
        if penalised:
            last -= self._weight * self._run_penalty_turnovers * held
        super().insert(item, parent, last)
        node = self._nodes[item]
        node.run = run
        node.penalised = penalised

    def remove(self, item: int) -> None:
        node = self._nodes[item]
        cold = node.penalised and not node.protected  # penalised, and never hit since
        super().remove(item)
        if cold:
            ghosts = self._cold_ghosts
            ghosts[item] = None
            held = max(1, min(len(self._nodes), self.capacity))
            while len(ghosts) > held:
                ghosts.popitem(last=False)

    def _learn(self, item: int) -> None:
        """ARC's adaptation, applied to the penalty's weight, on a miss of `item`."""
        b1, b2 = self._ghosts
        held = max(1, min(len(self._nodes), self.capacity))
        if item in self._cold_ghosts:  # the penalty cost this hit
            del self._cold_ghosts[item]
            ratio = max(1.0, (len(b1) + len(b2)) / max(1, len(self._cold_ghosts)))
            self._weight = max(0.0, self._weight - ratio / held)
        elif item in b1 or item in b2:  # room that penalised blocks held would have kept it
            ratio = max(1.0, len(self._cold_ghosts) / max(1, len(b1) + len(b2)))
            self._weight = min(1.0, self._weight + ratio / held)

    def access(self, item: int, now: float) -> None:
        self._tick(now)
        self._seen.add(item, min(len(self._nodes), self.capacity))
        super().access(item, self._clock)

    def _tick(self, now: float) -> None:
        self._ops += 1
        if now != self._now:
            self._now = now
            self._clock = float(self._ops)


class _SeenSketch:
    """Whether an id was used before, over a long window: a count-min sketch with aging.

    The ghost lists remember one cache's worth of evicted ids; reuse on long-context traces is
    ten to a hundred times further away (Mooncake: a first reuse comes a median 573 requests
    later), so "new" needs a longer memory than they have. At least
    `SKETCH_COUNTERS_PER_ITEM` one-byte counters per item held in each of `SKETCH_ROWS` rows,
    rounded up to a power of two (64-128 B per item); every counter is halved after
    `SKETCH_AGING_FACTOR` × width additions (TinyLFU's reset), so ids used once long ago fade.
    """

    __slots__ = ("_additions", "_rows", "_width")

    def __init__(self) -> None:
        self._width = 0
        self._rows: list[bytearray] = []
        self._additions = 0

    def add(self, item: int, held: int) -> bool:
        """Count one use of `item`; True if it had been used before (as far as the sketch knows)."""
        if self._width < SKETCH_COUNTERS_PER_ITEM * held:  # the tier is still filling: grow
            self._width = 1 << max(4, (SKETCH_COUNTERS_PER_ITEM * held - 1).bit_length())
            self._rows = [bytearray(self._width) for _ in range(SKETCH_ROWS)]
            self._additions = 0
        mask = self._width - 1
        r0, r1, r2, r3 = self._rows
        i0, i1 = ((item * _M0) >> 17) & mask, ((item * _M1) >> 17) & mask
        i2, i3 = ((item * _M2) >> 17) & mask, ((item * _M3) >> 17) & mask
        c0, c1, c2, c3 = r0[i0], r1[i1], r2[i2], r3[i3]
        least = min(c0, c1, c2, c3)
        if least < SKETCH_COUNT_MAX:  # conservative update: only the least counters grow
            more = least + 1
            if c0 == least:
                r0[i0] = more
            if c1 == least:
                r1[i1] = more
            if c2 == least:
                r2[i2] = more
            if c3 == least:
                r3[i3] = more
        self._additions += 1
        if self._additions >= SKETCH_AGING_FACTOR * self._width:
            self._additions = 0
            self._rows = [bytearray(v >> 1 for v in row) for row in self._rows]
        return least > 0
