"""Leases and reservations: who holds which extent, and when an extent may go back.

Extent safety: an extent under lease is never freed, reused, evicted or demoted; a record
dropped while its extent is leased leaves the extent "deferred" until the last lease ends
(`release_extent`). Reserved extents belong to their reservation until commit or expiry.
Called with the engine lock held.
"""

from __future__ import annotations

import bisect
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from dpu_agent.engine import journal as jr
from dpu_agent.engine._commit import CommitLog
from dpu_agent.engine._tenants import Tenants
from dpu_agent.engine.errors import LeaseExpired, LimitExceeded, ReservationExpired
from dpu_agent.engine.index import STATE_LIVE, RecordIndex
from dpu_agent.engine.types import Lease, PendingReservation, TenantState

_Expiring = TypeVar("_Expiring", Lease, PendingReservation)  # entries with an `expires` time

__all__ = ["COUNT_MAX", "LEASED_HITS_MAX", "LEASES_MAX", "RESERVATIONS_MAX", "SCALAR_HITS_MAX",
           "TENANT_LEASED_HITS_MAX", "TENANT_LEASES_MAX", "TENANT_RESERVATIONS_MAX",
           "Leases"]  # fmt: skip

LEASES_MAX = 65536  # open leases; readers release within the TTL
# ... and the hits they hold, all together: a lease costs about 100 B per hit (up to 4,096 hits
# a lookup), so the count of leases alone let one tenant hold gigabytes (an attack pass: 790
# leases of 4,096 hits, +300 MiB; its share of leases allowed 6 GB). 2^21 hits: about 200 MB.
LEASED_HITS_MAX = 1 << 21
RESERVATIONS_MAX = 65536  # open two-phase writes, same reasoning
# One tenant's share of each table: a quarter, as of the control plane's connections, so a
# tenant that never releases (or commits) fills its own share and three quarters stay for the
# others. A reader holds a lease per lookup until it has read (milliseconds); 16,384 is 256
# connections with 64 lookups each in flight.
TENANT_LEASES_MAX = LEASES_MAX // 4
TENANT_LEASED_HITS_MAX = LEASED_HITS_MAX // 4  # 524,288: 256 connections x 64 x 32 hits
TENANT_RESERVATIONS_MAX = RESERVATIONS_MAX // 4
COUNT_MAX = 0xFFFF  # pin and lease counts are uint16 columns
UNLEASE_SCALAR_MAX = 16  # leases of up to this many extents are undone row by row
EXPIRED_REMEMBERED_MAX = 4096  # expired lease/reservation ids kept for precise error messages
SCALAR_HITS_MAX = 16  # a lookup's hit rows read and updated row by row; more through numpy

ID_BITS = 62  # lease and reservation ids: random, within the protocol's integers (< 2^63)
Extent = tuple[int, int, int]  # tenant id, tier, lba


class WritableExtents:
    """The extents of one tenant's tier that its hosts may write: those of its open
    reservations. The NVMe/TCP target asks (`covers`) from its event loop without the engine
    lock, so this has a lock of its own; reservations never overlap (the allocator's)."""

    __slots__ = ("_ends", "_lock", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, int] = {}  # start -> end (exclusive)
        self._lock = threading.Lock()

    def add(self, lba: int, count: int) -> None:
        with self._lock:
            if lba not in self._ends:
                bisect.insort(self._starts, lba)
            self._ends[lba] = lba + count

    def remove(self, lba: int) -> None:
        """Idempotent: a reservation taken, then reclaimed, is removed once."""
        with self._lock:
            if self._ends.pop(lba, None) is not None:
                del self._starts[bisect.bisect_left(self._starts, lba)]

    def covers(self, lba: int, count: int) -> bool:
        """Whether [lba, lba + count) lies inside one open reservation."""
        with self._lock:
            i = bisect.bisect_right(self._starts, lba) - 1
            return i >= 0 and lba + count <= self._ends[self._starts[i]]

    def __len__(self) -> int:
        return len(self._ends)


class Leases:
    """Owns the open leases and reservations (both in expiry order), the lease count of each
    leased extent, the deferred extents, the recently expired ids and the id counter."""

    def __init__(self, index: RecordIndex, tenants: Tenants, commit: CommitLog) -> None:
        self._index, self._tenants, self._commit = index, tenants, commit
        self.leases: OrderedDict[int, Lease] = OrderedDict()
        self.extent_counts: dict[Extent, int] = {}  # leased extent -> open leases on it
        self.deferred: dict[Extent, tuple[int, bool]] = {}  # -> (block count, quarantine)
        self.reservations: OrderedDict[int, PendingReservation] = OrderedDict()
        # tenant id -> its entries in self.leases / self.reservations (the shares' bounds)
        self._tenant_leases: dict[int, int] = {}
        self._tenant_reservations: dict[int, int] = {}
        self.leased_hits = 0  # the hits (extents) of every open lease
        self._tenant_hits: dict[int, int] = {}  # tenant id -> the hits of its open leases
        self._expired_leases: OrderedDict[int, float] = OrderedDict()
        self._expired_reservations: OrderedDict[int, float] = OrderedDict()
        # (tenant id, tier) -> what its hosts may write over NVMe/TCP: its open reservations
        self.writable: dict[tuple[int, int], WritableExtents] = {}

    def next_id(self) -> int:
        """A random id for a lease or reservation, none open or remembered: ids from an
        earlier run are not mistaken for live ones, and no tenant can count another's leases
        and reservations from the gaps between its own (one counter did that, an attack
        pass found)."""
        while True:
            ident = secrets.randbits(ID_BITS)
            if ident and not (
                ident in self.leases or ident in self.reservations
                or ident in self._expired_leases or ident in self._expired_reservations
            ):  # fmt: skip
                return ident

    def count(self, tenant_id: int) -> tuple[int, int]:
        """(open leases, open reservations) of a tenant."""
        return (self._tenant_leases.get(tenant_id, 0),
                self._tenant_reservations.get(tenant_id, 0))  # fmt: skip

    # --- leases --------------------------------------------------------------------------------

    def check_room(self, tenant_id: int, rows: list[int], now: float) -> None:
        """Room for one more lease of the tenant over `rows` (expiring old ones first), or
        LimitExceeded."""
        mine = self._tenant_leases.get(tenant_id, 0)
        if mine >= TENANT_LEASES_MAX or len(self.leases) >= LEASES_MAX:
            self.expire(now)
            if self._tenant_leases.get(tenant_id, 0) >= TENANT_LEASES_MAX:
                raise LimitExceeded(f"this tenant holds {TENANT_LEASES_MAX} open leases (its "
                                    "share); release() leases after reading")  # fmt: skip
            if len(self.leases) >= LEASES_MAX:
                raise LimitExceeded(f"{LEASES_MAX} leases are open; release() leases after reading")
        n = len(rows)
        if (
            self._tenant_hits.get(tenant_id, 0) + n > TENANT_LEASED_HITS_MAX
            or self.leased_hits + n > LEASED_HITS_MAX
        ):
            self.expire(now)
            if self._tenant_hits.get(tenant_id, 0) + n > TENANT_LEASED_HITS_MAX:
                share = TENANT_LEASED_HITS_MAX
                raise LimitExceeded(f"this tenant's open leases hold {share} chunks (its "
                                    "share); release() leases after reading")  # fmt: skip
            if self.leased_hits + n > LEASED_HITS_MAX:
                raise LimitExceeded(f"open leases hold {LEASED_HITS_MAX} chunks; release() "
                                    "leases after reading")  # fmt: skip
        if len(rows) > SCALAR_HITS_MAX:
            most = int(self._index.cols["lease"][rows].max())
        else:
            lease_v = self._index.col_views["lease"]
            most = max(lease_v[r] for r in rows)
        if most >= COUNT_MAX:
            raise LimitExceeded(f"a chunk already has {COUNT_MAX} leases; release some first")

    def open(self, tenant_id: int, extents: list[tuple[int, int, int, int]], expires: float) -> int:
        """Record a lease over extents whose counts the caller already raised; its id."""
        held = Lease(lease_id=self.next_id(), tenant_id=tenant_id, extents=extents,
                     expires=expires)  # fmt: skip
        self.leases[held.lease_id] = held
        self._tenant_leases[tenant_id] = self._tenant_leases.get(tenant_id, 0) + 1
        self.leased_hits += len(extents)
        self._tenant_hits[tenant_id] = self._tenant_hits.get(tenant_id, 0) + len(extents)
        return held.lease_id

    def lease_extent(self, tid: int, tier: int, lba: int, row: int) -> None:
        k = (tid, tier, lba)
        self.extent_counts[k] = self.extent_counts.get(k, 0) + 1
        self._index.cols["lease"][row] += 1

    def release(self, ts: TenantState, lease_id: int, clock: Callable[[], float]) -> None:
        """End a lease. Raises LeaseExpired when it was already reclaimed after its TTL (the
        clock is read only then: releases are on the hot path)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.tenant_id != ts.tenant_id:
            raise self._lease_gone(ts, lease_id, clock())
        del self.leases[lease_id]
        _drop_one(self._tenant_leases, lease.tenant_id)
        self._end_lease(lease)

    def _end_lease(self, lease: Lease) -> None:
        """`unlease` an entry of the table (opened by `open`), and take back its hits."""
        if lease.extents:
            self.leased_hits -= len(lease.extents)
            left = self._tenant_hits[lease.tenant_id] - len(lease.extents)
            assert left >= 0, lease.lease_id
            if left:
                self._tenant_hits[lease.tenant_id] = left
            else:
                del self._tenant_hits[lease.tenant_id]
        self.unlease(lease)

    def unlease(self, lease: Lease) -> None:
        """Undo a lease's counts; extents deferred under it go back once no lease holds them."""
        cols = self._index.cols
        ts = self._tenants.by_id(lease.tenant_id)
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
            left = self.extent_counts[k] - 1
            assert left >= 0, k
            if left:
                self.extent_counts[k] = left
                continue
            del self.extent_counts[k]
            if k in self.deferred:
                count, quarantine = self.deferred.pop(k)
                self._finish_release(ts, tier, lba, count, quarantine)

    def _lease_gone(self, ts: TenantState, lease_id: int, now: float) -> LeaseExpired:
        expired_at = self._expired_leases.get(lease_id)
        return LeaseExpired(_gone_text("lease", lease_id, ts.name, expired_at, now))

    # --- extents going back --------------------------------------------------------------------

    def release_extent(self, ts: TenantState, t: int, lba: int, n: int, quarantine: bool) -> bool:
        """Free (or quarantine) an extent no record holds any more; while a lease holds it, it
        is deferred to the last lease's end instead (returns True then)."""
        k = (ts.tenant_id, t, lba)
        if k in self.extent_counts:
            prior = self.deferred.get(k, (n, False))[1]
            self.deferred[k] = (n, quarantine or prior)
            return True
        self._finish_release(ts, t, lba, n, quarantine)
        return False

    def _finish_release(self, ts: TenantState, t: int, lba: int, n: int, quarantine: bool) -> None:
        tier = ts.tiers[t]
        if not quarantine:
            tier.alloc.free(lba, n)
            return
        tier.quarantined[lba] = n
        if tier.spec.persistent:
            seq = self._commit.next_seq()
            self._commit.append_soft(jr.pack_extent(jr.OP_QUARANTINE, ts.tenant_id, seq, t, lba, n))

    # --- reservations --------------------------------------------------------------------------

    def check_reservation_room(self, tenant_id: int, now: float) -> None:
        mine = self._tenant_reservations.get(tenant_id, 0)
        if mine >= TENANT_RESERVATIONS_MAX or len(self.reservations) >= RESERVATIONS_MAX:
            self.expire(now)
            if self._tenant_reservations.get(tenant_id, 0) >= TENANT_RESERVATIONS_MAX:
                raise LimitExceeded(
                    f"this tenant holds {TENANT_RESERVATIONS_MAX} open reservations (its "
                    "share); commit or abort them, or let them expire"
                )
            if len(self.reservations) >= RESERVATIONS_MAX:
                raise LimitExceeded(
                    f"{RESERVATIONS_MAX} reservations are open; commit or let them expire"
                )

    def add_reservation(self, res: PendingReservation) -> None:
        self.reservations[res.reservation_id] = res
        tid = res.tenant_id
        writable = self.writable.get((tid, res.tier))
        if writable is None:
            writable = self.writable[(tid, res.tier)] = WritableExtents()
        writable.add(res.lba, res.block_count)
        self._tenant_reservations[tid] = self._tenant_reservations.get(tid, 0) + 1
        self._tenants.by_id(tid).reserved_blocks += res.block_count

    def take_reservation(
        self, ts: TenantState, rid: int, now: float, ttl_s: float
    ) -> PendingReservation:
        """Remove an open reservation of the tenant (its blocks still counted as reserved), or
        ReservationExpired (an expired one's blocks reclaimed first)."""
        res = self.reservations.get(rid)
        if res is None or res.tenant_id != ts.tenant_id:
            expired_at = self._expired_reservations.get(rid)
            raise ReservationExpired(_gone_text("reservation", rid, ts.name, expired_at, now))
        del self.reservations[rid]
        _drop_one(self._tenant_reservations, res.tenant_id)
        self._unwritable(res)  # committed or expired: its hosts write there no more
        if now > res.expires:
            self.reclaim_reservation(res)
            self._remember(self._expired_reservations, rid, res.expires)
            raise ReservationExpired(
                f"reservation {rid:#x} expired {(now - res.expires) * 1e3:.0f} ms ago "
                f"(TTL {ttl_s} s); reserve() again and rewrite the chunk"
            )
        return res

    def _unwritable(self, res: PendingReservation) -> None:
        writable = self.writable.get((res.tenant_id, res.tier))
        if writable is not None:
            writable.remove(res.lba)

    def reclaim_reservation(self, res: PendingReservation) -> None:
        self._unwritable(res)
        ts = self._tenants.by_id(res.tenant_id)
        ts.reserved_blocks -= res.block_count
        ts.tiers[res.tier].alloc.free(res.lba, res.block_count)

    # --- expiry and removal --------------------------------------------------------------------

    @staticmethod
    def _remember(table: OrderedDict[int, float], ident: int, when: float) -> None:
        table[ident] = when
        while len(table) > EXPIRED_REMEMBERED_MAX:
            table.popitem(last=False)

    def expire(self, now: float) -> tuple[int, int]:
        """Reclaim reservations and leases past their TTL (both tables are in expiry order)."""
        reservations = self._expire_table(
            self.reservations, self._tenant_reservations, self.reclaim_reservation,
            self._expired_reservations, now,
        )  # fmt: skip
        leases = self._expire_table(
            self.leases, self._tenant_leases, self._end_lease, self._expired_leases, now
        )
        return reservations, leases

    def _expire_table(
        self,
        table: OrderedDict[int, _Expiring],
        per_tenant: dict[int, int],
        reclaim: Callable[[_Expiring], None],
        remembered: OrderedDict[int, float],
        now: float,
    ) -> int:
        """Drop the entries of `table` (in expiry order) past their TTL, reclaiming each."""
        count = 0
        while table:
            ident, entry = next(iter(table.items()))
            if entry.expires > now:
                break
            del table[ident]
            _drop_one(per_tenant, entry.tenant_id)
            reclaim(entry)
            self._remember(remembered, ident, entry.expires)
            count += 1
        return count

    def forget_tenant(self, tid: int) -> None:
        """Drop a removed tenant's leases, reservations, lease counts and deferred extents."""
        for table in (self.leases, self.reservations):
            for ident in [i for i, v in table.items() if v.tenant_id == tid]:
                del table[ident]
        self._tenant_leases.pop(tid, None)
        self._tenant_reservations.pop(tid, None)
        for tier_key in [k for k in self.writable if k[0] == tid]:
            del self.writable[tier_key]
        self.leased_hits -= self._tenant_hits.pop(tid, 0)
        for k in [k for k in self.extent_counts if k[0] == tid]:
            del self.extent_counts[k]
        for k in [k for k in self.deferred if k[0] == tid]:
            del self.deferred[k]


def _drop_one(counts: dict[int, int], tenant_id: int) -> None:
    left = counts[tenant_id] - 1
    assert left >= 0, tenant_id
    if left:
        counts[tenant_id] = left
    else:
        del counts[tenant_id]


# Why a lease or reservation is not there, by kind: what its expiry lost, what "not there for
# this tenant" means, and what the caller does about either.
_GONE = {
    "lease": (
        "its extents may have been reused; discard what was read under it",
        "is not held by tenant {tenant!r} (never granted, already released",
        "lookup() again",
    ),
    "reservation": (
        "its extent was reclaimed",
        "is not open for tenant {tenant!r} (never made, already committed",
        "reserve() again and rewrite the chunk",
    ),
}


def _gone_text(kind: str, ident: int, tenant: str, expired_at: float | None, now: float) -> str:
    """It expired (when, and what that lost), or it was never there for this tenant."""
    lost, unknown, retry = _GONE[kind]
    if expired_at is not None:
        ago_ms = (now - expired_at) * 1e3
        return f"{kind} {ident:#x} expired {ago_ms:.0f} ms ago and {lost}; {retry}"
    return f"{kind} {ident:#x} {unknown.format(tenant=tenant)}, or expired long ago); {retry}"
