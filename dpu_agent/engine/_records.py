"""Record bookkeeping shared by the engine's operations: eviction-policy tracking, dropping
records (deferred while leased, or quarantined), lease accounting, journaling, expiry.

`EngineCore` (in `_core.py`) owns the state these methods use; it is declared here for mypy.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from dpu_agent.engine import journal as jr
from dpu_agent.engine.errors import JournalUnavailable
from dpu_agent.engine.index import STATE_LIVE, RecordIndex
from dpu_agent.engine.journal import Journal, JournalError
from dpu_agent.engine.tiers import Tier
from dpu_agent.engine.types import (
    ChunkLocation,
    EngineConfig,
    Lease,
    PendingReservation,
    TenantState,
)
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ITEM_ROW_BITS", "ROW_MASK", "RecordBookkeeping"]

log = get_logger(__name__)

ITEM_ROW_BITS = 32  # policy item = seq << 32 | row: unique forever, so never confused
ROW_MASK = (1 << ITEM_ROW_BITS) - 1
UNLEASE_SCALAR_MAX = 16  # leases of up to this many extents are undone row by row
EXPIRED_REMEMBERED_MAX = 4096  # expired lease/reservation ids kept for precise error messages

_INTEGRITY = Counter(
    "kvtier_engine_integrity_failures",
    "Checksum mismatches (chunk quarantined)",
    ["tenant", "tier"],
    registry=REGISTRY,
)


_FENCED = Gauge(
    "kvtier_engine_journal_fenced",
    "1 while the journal cannot take writes and the engine refuses them",
    registry=REGISTRY,
)
_JOURNAL_ERRORS = Counter(
    "kvtier_engine_journal_errors",
    "Journal appends or fsyncs that failed (each fences writes until a probe passes)",
    ["reason"],
    registry=REGISTRY,
)


class RecordBookkeeping:
    """The engine's record-level helpers; all are called with the engine lock held."""

    config: EngineConfig
    _clock: Callable[[], float]
    _epoch: float
    _index: RecordIndex
    _journal: Journal
    _seq: int
    _by_id: dict[int, TenantState]
    _leases: OrderedDict[int, Lease]
    _extent_leases: dict[tuple[int, int, int], int]
    _deferred: dict[tuple[int, int, int], tuple[int, bool]]
    _reservations: OrderedDict[int, PendingReservation]
    _expired_leases: OrderedDict[int, float]
    _expired_reservations: OrderedDict[int, float]
    _fence: JournalError | None

    # --- the journal, always before the index ---

    def _check_writable(self) -> None:
        """Refuse a write while the journal is fenced (reads go on)."""
        if self._fence is not None:
            raise self._unavailable(self._fence)

    @staticmethod
    def _unavailable(e: JournalError) -> JournalUnavailable:
        full = e.errno == errno.ENOSPC
        what = "the disk holding the journal is full" if full else "the journal cannot be written"
        return JournalUnavailable(
            f"writes refused: {what} ({e}); free space or fix the disk, the agent retries "
            "every tick; reads are still served",
            full=full,
        )

    def _set_fence(self, e: JournalError) -> None:
        _JOURNAL_ERRORS.labels("full" if e.errno == errno.ENOSPC else "io").inc()
        if self._fence is None:
            log.error("engine.journal_fenced", error=str(e), errno=e.errno)
            _FENCED.set(1)
        self._fence = e

    def _lift_fence(self) -> None:
        log.warning("engine.journal_writable", was=str(self._fence))
        self._fence = None
        _FENCED.set(0)

    def _wal(self, body: bytes) -> None:
        """Append one frame; on failure fence writes and raise JournalUnavailable. Callers
        append before they change the index, so a failure leaves nothing half-done."""
        self._check_writable()
        try:
            self._journal.append(body)
        except JournalError as e:
            self._set_fence(e)
            raise self._unavailable(e) from e

    def _wal_soft(self, body: bytes) -> None:
        """Append a frame whose loss costs no acknowledged data (a quarantine, a segment
        header); on failure fence writes but do not raise (the state it records is kept in
        memory and goes into the next checkpoint)."""
        if self._fence is not None:
            return
        try:
            self._journal.append(body)
        except JournalError as e:
            self._set_fence(e)

    def _location(self, row: int, key: bytes) -> ChunkLocation:
        cols = self._index.cols
        return ChunkLocation(
            key=key,
            nsid=int(cols["tier"][row]) + 1,
            lba=int(cols["lba"][row]),
            block_count=int(cols["block_count"][row]),
            length=int(cols["length"][row]),
            checksum=self._checksum(row),
        )

    def _checksum(self, row: int) -> bytes:
        cols = self._index.cols
        return int(cols["c0"][row]).to_bytes(8, "little") + int(cols["c1"][row]).to_bytes(
            8, "little"
        )

    def _lease_extent(self, tid: int, tier: int, lba: int, row: int) -> None:
        k = (tid, tier, lba)
        self._extent_leases[k] = self._extent_leases.get(k, 0) + 1
        self._index.cols["lease"][row] += 1

    def _unlease(self, lease: Lease) -> None:
        cols = self._index.cols
        ts = self._by_id[lease.tenant_id]
        if len(lease.extents) > UNLEASE_SCALAR_MAX:
            # rows that still hold the leased extent (not deleted, moved or reused since)
            tiers, lbas, _counts, rows = (np.array(v) for v in zip(*lease.extents, strict=True))
            same = (cols["state"][rows] == STATE_LIVE) & (cols["tenant"][rows] == lease.tenant_id)
            same &= (cols["tier"][rows] == tiers) & (cols["lba"][rows] == lbas.astype(np.uint64))
            held = rows[same]
            assert (cols["lease"][held] > 0).all(), lease.lease_id
            cols["lease"][held] -= 1  # numpy subtracts once per distinct row
        elif lease.extents:  # the same, row by row through memoryviews (cheaper for a few)
            v = self._index.col_views
            state_v, tenant_v, tier_v, lba_v = v["state"], v["tenant"], v["tier"], v["lba"]
            lease_v = v["lease"]
            for tier, lba, _count, row in {e[3]: e for e in lease.extents}.values():
                if (state_v[row] == STATE_LIVE and tenant_v[row] == lease.tenant_id
                        and tier_v[row] == tier and lba_v[row] == lba):  # fmt: skip
                    assert lease_v[row] > 0, lease.lease_id
                    lease_v[row] -= 1
        for tier, lba, _count, _row in lease.extents:
            k = (lease.tenant_id, tier, lba)
            left = self._extent_leases[k] - 1
            assert left >= 0, k
            if left:
                self._extent_leases[k] = left
                continue
            del self._extent_leases[k]
            if k in self._deferred:
                count, quarantine = self._deferred.pop(k)
                self._finish_release(ts, tier, lba, count, quarantine)

    def _reclaim_reservation(self, res: PendingReservation) -> None:
        ts = self._by_id[res.tenant_id]
        ts.reserved_blocks -= res.block_count
        ts.tiers[res.tier].alloc.free(res.lba, res.block_count)

    def _victim(self, tier: Tier, now: float) -> int | None:
        """Recovered chunks not used since the restart go first (leaves, oldest first), then
        the policy's choice. Returns a row."""
        cols = self._index.cols
        while tier.cold_pos < len(tier.cold):
            item = int(tier.cold[tier.cold_pos])
            tier.cold_pos += 1
            row = item & ROW_MASK
            stale = (
                cols["state"][row] != STATE_LIVE or int(cols["seq"][row]) != item >> ITEM_ROW_BITS
            )
            if stale or item in tier.policy:
                continue
            if self._evictable(item):
                return row
            self._policy_insert(tier, row, now)  # pinned or leased: let the policy track it
        if len(tier.cold):
            tier.cold, tier.cold_pos = tier.cold[:0], 0
        chosen = tier.policy.victim(self._evictable)
        return None if chosen is None else chosen & ROW_MASK

    def _evictable(self, item: int) -> bool:
        row = item & ROW_MASK
        cols = self._index.cols
        return bool(cols["pin"][row] == 0 and cols["lease"][row] == 0)

    def _item(self, row: int) -> int:
        return (int(self._index.cols["seq"][row]) << ITEM_ROW_BITS) | row

    def _track(self, ts: TenantState, t: int, row: int, now: float) -> None:
        tier = ts.tiers[t]
        self._policy_insert(tier, row, now)
        tier.records += 1
        tier.used_blocks_records += int(self._index.cols["block_count"][row])

    def _policy_insert(self, tier: Tier, row: int, now: float) -> None:
        cols = self._index.cols
        parent = int(cols["parent"][row])
        parent_item = None
        if parent >= 0 and cols["state"][parent] == STATE_LIVE:
            item = self._item(parent)
            if cols["tenant"][parent] == cols["tenant"][row] and item in tier.policy:
                parent_item = item
        tier.policy.insert(self._item(row), parent_item, now - self._epoch)

    def _untrack(self, ts: TenantState, t: int, row: int) -> None:
        tier = ts.tiers[t]
        item = self._item(row)
        if item in tier.policy:  # else: a recovered chunk still in the cold list (skipped there)
            tier.policy.remove(item)
        tier.records -= 1
        tier.used_blocks_records -= int(self._index.cols["block_count"][row])

    def _drop(self, ts: TenantState, row: int, *, quarantine: bool = False) -> None:
        """Remove a record; its extent is freed (or quarantined) once no lease holds it."""
        cols = self._index.cols
        t, lba, n = int(cols["tier"][row]), int(cols["lba"][row]), int(cols["block_count"][row])
        if ts.tiers[t].spec.persistent:  # journal first: a failure changes nothing
            key = self._index.key_of(row)
            self._wal(jr.pack_delete(ts.tenant_id, self._next_seq(), key))
        self._untrack(ts, t, row)
        self._index.remove(row)
        k = (ts.tenant_id, t, lba)
        if k in self._extent_leases:
            prior = self._deferred.get(k, (n, False))[1]
            self._deferred[k] = (n, quarantine or prior)
        else:
            self._finish_release(ts, t, lba, n, quarantine)

    def _finish_release(self, ts: TenantState, t: int, lba: int, n: int, quarantine: bool) -> None:
        tier = ts.tiers[t]
        if not quarantine:
            tier.alloc.free(lba, n)
            return
        tier.quarantined[lba] = n
        if tier.spec.persistent:
            body = jr.pack_extent(jr.OP_QUARANTINE, ts.tenant_id, self._next_seq(), t, lba, n)
            self._wal_soft(body)

    def _integrity_failure(self, ts: TenantState, row: int) -> None:
        tier_name = ts.tiers[int(self._index.cols["tier"][row])].spec.name
        ts.integrity_failures += 1
        _INTEGRITY.labels(ts.name, tier_name).inc()
        log.warning(
            "engine.checksum_mismatch",
            tenant=ts.name,
            tier=tier_name,
            lba=int(self._index.cols["lba"][row]),
            key=self._index.key_of(row).hex(),
        )
        self._drop(ts, row, quarantine=True)

    def _parent_key(self, row: int) -> bytes | None:
        cols = self._index.cols
        parent = int(cols["parent"][row])
        if parent < 0 or cols["state"][parent] != STATE_LIVE:
            return None
        if cols["tenant"][parent] != cols["tenant"][row]:
            return None
        return self._index.key_of(parent)

    def _journal_move(self, ts: TenantState, row: int, tier: int, lba: int, generation: int) -> int:
        """Journal the record of `row` at a new place (a demotion) before the index changes;
        returns the new sequence number. JournalUnavailable on failure."""
        cols = self._index.cols
        seq = self._next_seq()
        self._wal(
            jr.pack_commit(
                ts.tenant_id,
                seq,
                self._index.key_of(row),
                self._checksum(row),
                tier,
                lba,
                int(cols["block_count"][row]),
                int(cols["length"][row]),
                generation,
                int(cols["created"][row]),
                self._parent_key(row),
            )
        )
        return seq

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    @staticmethod
    def _remember(table: OrderedDict[int, float], ident: int, when: float) -> None:
        table[ident] = when
        while len(table) > EXPIRED_REMEMBERED_MAX:
            table.popitem(last=False)

    def _expire(self, now: float) -> tuple[int, int]:
        """Reclaim reservations and leases past their TTL (both tables are in expiry order)."""
        reservations = leases = 0
        while self._reservations:
            rid, res = next(iter(self._reservations.items()))
            if res.expires > now:
                break
            del self._reservations[rid]
            self._reclaim_reservation(res)
            self._remember(self._expired_reservations, rid, res.expires)
            reservations += 1
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))
            if lease.expires > now:
                break
            del self._leases[lease_id]
            self._unlease(lease)
            self._remember(self._expired_leases, lease_id, lease.expires)
            leases += 1
        return reservations, leases
