"""Record operations over the index: commit, drop and move a record (journal first, always:
a change the journal refused never reaches the index), the eviction-policy bookkeeping of
each tier (track, untrack, victim) and integrity failures. Called with the engine lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dpu_agent.engine import journal as jr
from dpu_agent.engine._commit import CommitLog
from dpu_agent.engine._leases import Leases
from dpu_agent.engine.index import NO_ROW, STATE_LIVE, RecordIndex
from dpu_agent.engine.tiers import Tier
from dpu_agent.engine.types import ChunkLocation, PendingReservation, TenantState
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter

__all__ = ["ITEM_ROW_BITS", "ROW_MASK", "Records", "item_of"]

log = get_logger(__name__)

# A recovered row waiting in a tier's cold list is `seq << 32 | row`: the seq tells a row reused
# since the restart from the record it was.
ITEM_ROW_BITS = 32
ROW_MASK = (1 << ITEM_ROW_BITS) - 1
# A policy item is a 64-bit hash of the chunk's 128-bit key, so a chunk that is evicted and put
# again is the same item: LRU-2's history and the ghost lists of ARC and S3-FIFO see it return.
# Two live keys of one tier sharing a hash (odds ~n^2 / 2^65) is handled, not assumed away: the
# later one gets COLLIDED | row, outside the hash range, for as long as it stays.
_MIX = 0x9E3779B97F4A7C15  # odd (golden ratio): multiplying spreads k1 over all 64 bits
_MASK64 = (1 << 64) - 1
COLLIDED = 1 << 64


def item_of(k0: int, k1: int) -> int:
    """The policy item of the key whose little-endian words are (k0, k1)."""
    return (k0 ^ (k1 * _MIX)) & _MASK64


def items_of(k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
    """`item_of` over arrays of key words (uint64; the product wraps as item_of's mask does)."""
    with np.errstate(over="ignore"):
        return k0.astype(np.uint64) ^ (k1.astype(np.uint64) * np.uint64(_MIX))


_INTEGRITY = Counter(
    "kvtier_engine_integrity_failures",
    "Checksum mismatches (chunk quarantined)",
    ["tenant", "tier"],
    registry=REGISTRY,
)


class Records:
    """Changes records through the commit log and the index, and keeps each tier's eviction
    policy in step. Holds no state of its own: the index holds the records, each `Tier` its
    policy and cold list, `Leases` the extents in use."""

    def __init__(
        self,
        index: RecordIndex,
        commit: CommitLog,
        leases: Leases,
        *,
        epoch: float,
        wall_clock: Callable[[], float],
    ) -> None:
        self.index, self._commit, self._leases = index, commit, leases
        self._epoch, self._wall = epoch, wall_clock

    # --- reading a row -------------------------------------------------------------------------

    def location(self, row: int, key: bytes) -> ChunkLocation:
        cols = self.index.cols
        return ChunkLocation(
            key=key,
            nsid=int(cols["tier"][row]) + 1,
            lba=int(cols["lba"][row]),
            block_count=int(cols["block_count"][row]),
            length=int(cols["length"][row]),
            checksum=self.checksum(row),
        )

    def checksum(self, row: int) -> bytes:
        cols = self.index.cols
        return int(cols["c0"][row]).to_bytes(8, "little") + int(cols["c1"][row]).to_bytes(
            8, "little"
        )

    def parent_key(self, row: int) -> bytes | None:
        cols = self.index.cols
        parent = int(cols["parent"][row])
        if parent < 0 or cols["state"][parent] != STATE_LIVE:
            return None
        if cols["tenant"][parent] != cols["tenant"][row]:
            return None
        return self.index.key_of(parent)

    # --- the eviction policy's view ------------------------------------------------------------

    def victim(self, tier: Tier, now: float, keep: int = NO_ROW) -> int | None:
        """Recovered chunks not used since the restart go first (leaves, oldest first), then
        the policy's choice. Returns a row, never `keep` (the chunk a put extends)."""
        cols = self.index.cols
        while tier.cold_pos < len(tier.cold):
            entry = int(tier.cold[tier.cold_pos])
            tier.cold_pos += 1
            row = entry & ROW_MASK
            stale = (
                cols["state"][row] != STATE_LIVE or int(cols["seq"][row]) != entry >> ITEM_ROW_BITS
            )
            if stale or self.item(tier, row) in tier.policy:
                continue
            if self.evictable(row) and row != keep:
                return row
            self.policy_insert(tier, row, now)  # pinned, leased or kept: the policy tracks it
        if len(tier.cold):
            tier.cold, tier.cold_pos = tier.cold[:0], 0
        rows = tier.rows
        chosen = tier.policy.victim(lambda item: rows[item] != keep and self.evictable(rows[item]))
        return None if chosen is None else rows[chosen]

    def evictable(self, row: int) -> bool:
        """Neither pinned nor leased."""
        cols = self.index.cols
        return bool(cols["pin"][row] == 0 and cols["lease"][row] == 0)

    def item(self, tier: Tier, row: int) -> int:
        """The policy item of `row` in `tier` (tracked there or not). A tracked row keeps the
        item it was given for as long as it is tracked: one given COLLIDED | row (its hash was
        another row's) stays so after that row leaves, or its removal would miss the policy's
        entry and leave it naming a dead row (a tenant choosing colliding keys stopped the
        agent at the next eviction)."""
        v = self.index.col_views
        item = item_of(v["k0"][row], v["k1"][row])
        held = tier.rows.get(item)
        if held == row:
            return item
        collided = COLLIDED | row
        if held is None and tier.rows.get(collided) != row:
            return item
        return collided  # tracked as collided, or another live key of this tier has the hash

    def track(self, ts: TenantState, t: int, row: int, now: float) -> None:
        tier = ts.tiers[t]
        self.policy_insert(tier, row, now)
        tier.records += 1
        tier.used_blocks_records += int(self.index.cols["block_count"][row])

    def policy_insert(self, tier: Tier, row: int, now: float) -> None:
        cols = self.index.cols
        parent = int(cols["parent"][row])
        parent_item = None
        if parent >= 0 and cols["state"][parent] == STATE_LIVE:
            item = self.item(tier, parent)
            if cols["tenant"][parent] == cols["tenant"][row] and item in tier.policy:
                parent_item = item
        item = self.item(tier, row)
        tier.rows[item] = row
        tier.policy.insert(item, parent_item, now - self._epoch)

    def adopt(
        self,
        tier: Tier,
        rows: Sequence[int],
        items: Sequence[int],
        used: Sequence[bool],
        now: float,
    ) -> int:
        """Hand recovered `rows` (with their policy `items`, first to go first, and whether
        each was used) to the tier's empty policy in one `adopt`; a parent is linked when it
        is adopted too. Returns how many."""
        cols = self.index.cols
        item_of_row = dict(zip(map(int, rows), map(int, items), strict=True))
        entries = []
        for row, item, u in zip(item_of_row, item_of_row.values(), used, strict=True):
            parent = int(cols["parent"][row])
            entries.append((item, item_of_row.get(parent), bool(u)))
            tier.rows[item] = row
        tier.policy.adopt(entries, now - self._epoch)
        return len(entries)

    def untrack(self, ts: TenantState, t: int, row: int) -> None:
        tier = ts.tiers[t]
        item = self.item(tier, row)
        if item in tier.policy:  # else: a recovered chunk still in the cold list (skipped there)
            tier.policy.remove(item)
            del tier.rows[item]
        tier.records -= 1
        tier.used_blocks_records -= int(self.index.cols["block_count"][row])

    # --- changing records: journal first -------------------------------------------------------

    def insert(self, ts: TenantState, res: PendingReservation, checksum: bytes, now: float) -> int:
        """Journal (persistent tier), then index: a commit the journal refused is never served."""
        parent_row = NO_ROW
        if res.parent is not None:
            parent_row = self.index.find(ts.tenant_id, res.parent)
        tier = ts.tiers[res.tier]
        seq = self._commit.next_seq()
        created, generation = int(self._wall()), tier.devices.key_generation
        if tier.spec.persistent:
            self._commit.append(
                jr.pack_commit(ts.tenant_id, seq, res.key, checksum, res.tier, res.lba,
                               res.block_count, res.length, generation, created, res.parent)
            )  # fmt: skip
        row = self.index.insert(
            ts.tenant_id,
            res.key,
            c0=int.from_bytes(checksum[:8], "little"),
            c1=int.from_bytes(checksum[8:], "little"),
            lba=res.lba,
            seq=seq,
            block_count=res.block_count,
            length=res.length,
            generation=generation,
            created=created,
            access_count=0,
            parent=parent_row,
            last_access=now - self._epoch,
            prev_access=0.0,
            tier=res.tier,
        )
        self.track(ts, res.tier, row, now)
        return row

    def drop(self, ts: TenantState, row: int, *, quarantine: bool = False) -> None:
        """Remove a record; its extent is freed (or quarantined) once no lease holds it."""
        cols = self.index.cols
        t, lba, n = int(cols["tier"][row]), int(cols["lba"][row]), int(cols["block_count"][row])
        if ts.tiers[t].spec.persistent:  # journal first: a failure changes nothing
            key = self.index.key_of(row)
            self._commit.append(jr.pack_delete(ts.tenant_id, self._commit.next_seq(), key))
        self.untrack(ts, t, row)
        self.index.remove(row)
        self._leases.release_extent(ts, t, lba, n, quarantine)

    def journal_move(self, ts: TenantState, row: int, tier: int, lba: int, generation: int) -> int:
        """Journal the record of `row` at a new place (a demotion) before the index changes;
        returns the new sequence number. JournalUnavailable on failure."""
        cols = self.index.cols
        seq = self._commit.next_seq()
        self._commit.append(
            jr.pack_commit(
                ts.tenant_id,
                seq,
                self.index.key_of(row),
                self.checksum(row),
                tier,
                lba,
                int(cols["block_count"][row]),
                int(cols["length"][row]),
                generation,
                int(cols["created"][row]),
                self.parent_key(row),
            )
        )
        return seq

    def integrity_failure(self, ts: TenantState, row: int) -> None:
        """A chunk failed its checksum: count it, drop the record, quarantine the extent."""
        tier_name = ts.tiers[int(self.index.cols["tier"][row])].spec.name
        ts.integrity_failures += 1
        _INTEGRITY.labels(ts.name, tier_name).inc()
        log.warning(
            "engine.checksum_mismatch",
            tenant=ts.name,
            tier=tier_name,
            lba=int(self.index.cols["lba"][row]),
            key=self.index.key_of(row).hex(),
        )
        self.drop(ts, row, quarantine=True)
