"""Allocation for writes: which tier a new chunk goes to, the room made for it by dropping
victims, and quotas. No chunk is copied here (demotion copies in the background tick,
outside the lock). Called with the engine lock held."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE
from dpu_agent.engine._leases import Leases
from dpu_agent.engine._records import Records
from dpu_agent.engine.errors import QuotaExceeded, TierFull
from dpu_agent.engine.index import NO_ROW
from dpu_agent.engine.tiers import DRAM, NVME
from dpu_agent.engine.types import TenantState
from dpu_agent.metrics import REGISTRY, Counter

__all__ = ["EVICTIONS", "SMALL_FRACTION", "Placement"]

EVICT_STEPS_MAX = 256  # evictions one placement may cause (mixed sizes can need several)
SMALL_FRACTION = 8  # chunks above 1/8 of the DRAM tier go straight to NVMe

EVICTIONS = Counter(
    "kvtier_engine_evictions",
    "Chunks that left a tier",
    ["tenant", "tier", "action"],
    registry=REGISTRY,
)


class Placement:
    """Places chunks in tiers and enforces quotas; its state is the tiers' allocators (in
    each `Tier`), which it and the data mover (`Mover`) change."""

    def __init__(self, records: Records, leases: Leases, clock: Callable[[], float]) -> None:
        self._records, self._leases, self._clock = records, leases, clock

    def place(
        self, ts: TenantState, n: int, length: int, now: float, keep: int = NO_ROW
    ) -> tuple[int, int]:
        """DRAM if it has room now, else NVMe (dropping NVMe victims), else DRAM dropping its
        victims: (tier, lba), or TierFull saying what holds the space. `keep` (the row of the
        chunk this one extends) is never dropped for it: a client building a prefix chain puts
        its chunks one by one, and the chunk just put is the newest leaf, the one prefix-aware
        policies would evict first; dropping it would cut the chain being written."""
        small = n <= ts.tiers[DRAM].alloc.block_count // SMALL_FRACTION
        steps = ((DRAM, False), (NVME, True), (DRAM, True)) if small else ((NVME, True),)
        for t, evict in steps:
            lba = self.make_room(ts, t, n, now, evict=evict, keep=keep)
            if lba is not None:
                return t, lba
        parts = []
        for tier in ts.tiers:
            parts.append(
                f"{tier.spec.name}: {tier.alloc.free_blocks} blocks free, largest extent "
                f"{tier.alloc.largest_free}"
            )
        index = self._records.index
        cols = index.cols
        live = index.live_rows()
        mine = live[cols["tenant"][live] == ts.tenant_id]
        pinned = int(np.count_nonzero(cols["pin"][mine]))
        leased = int(np.count_nonzero(cols["lease"][mine]))
        raise TierFull(
            f"tenant {ts.name!r}: no room for a chunk of {length} bytes ({n} blocks) even after "
            f"eviction ({'; '.join(parts)}; {pinned} chunks pinned, {leased} leased, "
            f"{len(self._leases.reservations)} reservations open); release leases, unpin or "
            "delete chunks, or give the tenant bigger tiers"
        )

    def make_room(
        self, ts: TenantState, t: int, n: int, now: float, *, evict: bool, keep: int = NO_ROW
    ) -> int | None:
        """Allocate `n` blocks in tier `t`, dropping its victims (never `keep`) when `evict`."""
        tier = ts.tiers[t]
        if n > tier.alloc.block_count:
            return None
        for _ in range(EVICT_STEPS_MAX):
            lba = tier.alloc.alloc(n)
            if lba is not None or not evict:
                return lba
            row = self._records.victim(tier, now, keep)
            if row is None:
                return None
            self._evict(ts, t, row)
        return None

    def _evict(self, ts: TenantState, t: int, row: int) -> None:
        assert self._records.evictable(row), row
        self._records.drop(ts, row)
        ts.evictions += 1
        EVICTIONS.labels(ts.name, ts.tiers[t].spec.name, "drop").inc()

    def enforce_quota(self, ts: TenantState, n: int) -> None:
        """Drop the tenant's coldest chunks until `n` more blocks fit its quota, or raise."""
        quota = ts.quota_bytes
        if not quota:
            return
        if n * BLOCK_SIZE > quota:
            raise QuotaExceeded(
                f"a chunk of {n * BLOCK_SIZE} bytes exceeds tenant {ts.name!r}'s quota of "
                f"{quota} bytes; raise the quota"
            )
        for _ in range(EVICT_STEPS_MAX):
            if (ts.used_blocks + n) * BLOCK_SIZE <= quota or not self.drop_one(ts):
                break
        if (ts.used_blocks + n) * BLOCK_SIZE > quota:
            raise QuotaExceeded(
                f"tenant {ts.name!r} uses {ts.used_blocks * BLOCK_SIZE} of its {quota}-byte "
                f"quota and cannot evict enough for {n * BLOCK_SIZE} more bytes (chunks pinned, "
                "leased or reserved); release leases, unpin or delete chunks, or raise the quota"
            )

    def drop_one(self, ts: TenantState) -> bool:
        """Drop the coldest evictable chunk of the tenant (NVMe first); False if there is none."""
        for t in (NVME, DRAM):
            row = self._records.victim(ts.tiers[t], self._clock())
            if row is not None:
                self._records.drop(ts, row)
                ts.evictions += 1
                EVICTIONS.labels(ts.name, ts.tiers[t].spec.name, "drop").inc()
                return True
        return False
