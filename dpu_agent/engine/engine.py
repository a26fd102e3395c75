"""The storage engine's public face: everything of the ARCHITECTURE.md contract not in _core.

`Engine` adds deletes, pins, operator eviction, stats, the periodic tick (expiry, group commit,
automatic checkpoints), checkpoints, a clean close, in-process chunk I/O, backup and restore.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE, BlockDeviceError
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import backup as backup_mod
from dpu_agent.engine import recovery
from dpu_agent.engine._core import (
    _EVICTIONS,
    _RECORDS,
    _USED,
    COUNT_MAX,
    SMALL_FRACTION,
    EngineCore,
    _check_key,
)
from dpu_agent.engine.errors import EngineError, JournalUnavailable, LimitExceeded, UnknownKey
from dpu_agent.engine.index import NO_ROW, STATE_LIVE
from dpu_agent.engine.journal import (
    OP_UNQUARANTINE,
    JournalError,
    pack_delete,
    pack_extent,
    pack_tenant_remove,
)
from dpu_agent.engine.tiers import DRAM, NVME, DeviceFactory
from dpu_agent.engine.types import ChunkLocation, EngineConfig, Lease, TenantState
from dpu_agent.log import get_logger
from kvproto.checksum import chunk_checksum

__all__ = ["CHUNKS_PAGE_MAX", "Engine"]

log = get_logger(__name__)

CHUNKS_PAGE_MAX = 1000  # rows of `dpuctl chunks ls` per request: ~150 KB, well under a frame
DEMOTIONS_PER_TICK_MAX = 256  # bounds one tick's work; the next tick goes on
DEMOTION_BYTES_PER_TICK_MAX = 256 << 20  # ~0.1-0.2 s of copying (XTS + checksum) per tick
PROMOTIONS_PER_TICK_MAX = 256  # as for demotions: bounds one tick's work, the next goes on
PROMOTION_BYTES_PER_TICK_MAX = 128 << 20  # NVMe reads at ~1.4 GB/s: under 0.1 s per tick
# Hot: read at least twice, the last two reads at most this far apart (LRU-2's test of a
# second reference); a conversation's think time is tens of seconds
PROMOTE_REREAD_S = 60.0


@dataclass(slots=True, kw_only=True)
class _Demotion:
    """A DRAM chunk being copied to NVMe outside the lock (its DRAM extent leased meanwhile)."""

    ts: TenantState
    row: int
    seq: int
    key: bytes
    checksum: bytes
    src: int
    dst: int
    block_count: int
    length: int
    lease: Lease


@dataclass(slots=True, kw_only=True)
class _Promotion:
    """An NVMe chunk being copied to DRAM outside the lock (its NVMe extent leased meanwhile)."""

    ts: TenantState
    row: int
    seq: int
    key: bytes
    checksum: bytes
    src: int
    dst: int
    block_count: int
    length: int
    lease: Lease


class Engine(EngineCore):
    """The context-memory tier's storage engine (docs/ENGINE.md). Thread-safe, synchronous."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        device_factory: DeviceFactory | None = None,
        keystore: KeyStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            config,
            device_factory=device_factory,
            keystore=keystore,
            clock=clock,
            wall_clock=wall_clock,
        )
        self._promote_since = 0.0  # engine-clock time of the last promotion scan
        r = self.recovery_report
        if r.torn_segments or r.damaged_frames or r.checkpoints_damaged or r.dropped_records:
            # a verified checkpoint of what survived, now: a later crash replays from it
            self.checkpoint()

    # --- record operations -----------------------------------------------------------------

    def delete(self, tenant: str, key: bytes) -> None:
        _check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            self._drop(ts, self._row_of(ts, key, "delete"))

    def pin(self, tenant: str, key: bytes) -> None:
        """Keep a chunk from eviction and demotion until unpin() (pins do not survive restart)."""
        _check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._row_of(ts, key, "pin")
            if self._index.cols["pin"][row] >= COUNT_MAX:
                raise LimitExceeded(f"chunk {key.hex()} already has {COUNT_MAX} pins")
            self._index.cols["pin"][row] += 1

    def unpin(self, tenant: str, key: bytes) -> None:
        _check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._row_of(ts, key, "unpin")
            if self._index.cols["pin"][row] == 0:
                raise EngineError(f"chunk {key.hex()} of tenant {ts.name!r} is not pinned")
            self._index.cols["pin"][row] -= 1

    def evict(self, tenant: str, nbytes: int) -> int:
        """Drop the tenant's coldest evictable chunks until `nbytes` are freed; returns bytes."""
        if nbytes <= 0:
            raise ValueError(f"evict {nbytes} bytes: give a positive byte count")
        freed = 0
        with self._lock:
            ts = self._tenant(tenant)
            while freed < nbytes:
                before = ts.used_blocks
                if not self._drop_one(ts):
                    break
                freed += (before - ts.used_blocks) * BLOCK_SIZE
        return freed

    def clear_quarantine(self, tenant: str) -> int:
        """Return quarantined extents to the allocators (after an operator checked the device).
        Returns the number of blocks released."""
        with self._lock:
            ts = self._tenant(tenant)
            released = 0
            for tier in ts.tiers:
                for lba, n in sorted(tier.quarantined.items()):
                    if tier.spec.persistent:  # journal first
                        t = tier.spec.index
                        body = pack_extent(
                            OP_UNQUARANTINE, ts.tenant_id, self._next_seq(), t, lba, n
                        )
                        self._wal(body)
                    del tier.quarantined[lba]
                    tier.alloc.free(lba, n)
                    released += n
            return released

    def report_corrupt(self, tenant: str, key: bytes) -> bool:
        """A reader found the chunk under `key` failing its checksum: drop the record and
        quarantine its extent (never reused until clear_quarantine), counted as an integrity
        failure. False when the tenant has no such chunk (already gone)."""
        _check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._index.find(ts.tenant_id, key)
            if row == NO_ROW:
                return False
            self._integrity_failure(ts, row)
            return True

    def remove_tenant(self, tenant: str) -> dict[str, Any]:
        """Crypto-erase a tenant: journal its removal, forget its records, leases and
        reservations, close its devices, then destroy its XTS keys and delete its NVMe file
        (device factories that can: the embedded one). Its blocks are unreadable after this;
        a tenant added later under the same name gets a new key and starts empty."""
        with self._lock:
            ts = self._tenant(tenant)
            tid = ts.tenant_id
            self._wal(pack_tenant_remove(tid, self._next_seq()))
            cols = self._index.cols
            live = self._index.live_rows()
            rows = live[cols["tenant"][live] == tid].tolist()
            for row in rows:
                self._index.remove(row)
            for table in (self._leases, self._reservations):
                for ident in [i for i, v in table.items() if v.tenant_id == tid]:
                    del table[ident]
            for k in [k for k in self._extent_leases if k[0] == tid]:
                del self._extent_leases[k]
            for k in [k for k in self._deferred if k[0] == tid]:
                del self._deferred[k]
            del self._tenants[tenant], self._by_id[tid]
            self._counters.pop(tid, None)
            for tier in ts.tiers:
                tier.device.close()
        erase = getattr(self._factory, "erase", None)
        key_destroyed = bool(erase(tenant)) if erase is not None else False
        log.info("engine.tenant_removed", tenant=tenant, records=len(rows),
                 key_destroyed=key_destroyed)  # fmt: skip
        return {"records_dropped": len(rows), "key_destroyed": key_destroyed}

    def _row_of(self, ts: TenantState, key: bytes, what: str) -> int:
        row = self._index.find(ts.tenant_id, key)
        if row == NO_ROW:
            raise UnknownKey(
                f"tenant {ts.name!r} has no chunk {key.hex()} to {what}; lookup() shows what is "
                "cached"
            )
        return row

    # --- in-process chunk I/O (tests, benchmarks, embedded callers) -------------------------

    def put_chunk(
        self, tenant: str, key: bytes, data: Any, parent: bytes | None = None
    ) -> ChunkLocation:
        """reserve, write (outside the lock), commit."""
        if isinstance(data, np.ndarray):  # any dtype, bfloat16 included: its bytes
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        checksum = chunk_checksum(key, view)
        res = self.reserve(tenant, key, len(view), parent)
        dev = self.namespaces(tenant)[res.nsid]
        try:
            if len(view) % BLOCK_SIZE:
                padded = bytearray(res.block_count * BLOCK_SIZE)
                padded[: len(view)] = view
                dev.write(res.lba, memoryview(padded))
            else:
                dev.write(res.lba, view)
        except BaseException:
            self.abort(tenant, res.reservation_id)  # the blocks go back at once, not at expiry
            raise
        return self.commit(tenant, res.reservation_id, checksum)

    def get_chunk(self, tenant: str, key: bytes) -> bytes | None:
        """The chunk's bytes, checksum verified; None on a miss or a mismatch (quarantined)."""
        result = self.lookup(tenant, [key])
        if not result.hits:
            return None
        assert result.lease_id is not None
        loc = result.hits[0]
        buf = bytearray(loc.block_count * BLOCK_SIZE)
        try:
            self.namespaces(tenant)[loc.nsid].read_into(loc.lba, memoryview(buf))
        finally:
            self.release(tenant, result.lease_id)
        data = bytes(memoryview(buf)[: loc.length])
        if chunk_checksum(key, data) == loc.checksum:
            return data
        with self._lock:
            ts = self._tenant(tenant)
            row = self._index.find(ts.tenant_id, key)
            cols = self._index.cols
            same = row != NO_ROW and int(cols["lba"][row]) == loc.lba
            same = same and self._checksum(row) == loc.checksum  # not a newer version
            if same and int(cols["tier"][row]) == loc.nsid - 1:
                self._integrity_failure(ts, row)
        return None

    # --- stats -----------------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        with self._lock:
            if tenant is not None:
                return self._tenant_stats(self._tenant(tenant))
            self._check_open()
            per = {name: self._tenant_stats(ts) for name, ts in sorted(self._tenants.items())}
            totals = {
                k: sum(int(s[k]) for s in per.values())
                for k in (
                    "records",
                    "hits",
                    "misses",
                    "evictions",
                    "demotions",
                    "promotions",
                    "integrity_failures",
                )
            }
            return {
                **totals,
                "tenants": per,
                "leases": len(self._leases),
                "reservations": len(self._reservations),
                "index_bytes": self._index.nbytes,
                "journal_segment": self._journal.segment,
                "journal_segment_bytes": self._journal.segment_bytes,
                "journal_fenced": "" if self._fence is None else str(self._fence),
                "seq": self._seq,
                "recovery": dataclasses.asdict(self.recovery_report),
            }

    def _tenant_stats(self, ts: TenantState) -> dict[str, Any]:
        tiers = {}
        for tier in ts.tiers:
            tiers[tier.spec.name] = {
                "nsid": tier.spec.nsid,
                "persistent": tier.spec.persistent,
                "records": tier.records,
                "capacity_bytes": tier.alloc.block_count * BLOCK_SIZE,
                "used_bytes": tier.alloc.used_blocks * BLOCK_SIZE,
                "free_bytes": tier.alloc.free_blocks * BLOCK_SIZE,
                "largest_free_bytes": tier.alloc.largest_free * BLOCK_SIZE,
                "free_extents": tier.alloc.extent_count,
                "quarantined_bytes": tier.quarantined_blocks * BLOCK_SIZE,
            }
        return {
            "tenant": ts.name,
            "records": sum(t.records for t in ts.tiers),
            "quota_bytes": ts.quota_bytes,
            "used_bytes": ts.used_blocks * BLOCK_SIZE,
            "hits": ts.hits,
            "misses": ts.misses,
            "evictions": ts.evictions,
            "demotions": ts.demotions,
            "promotions": ts.promotions,
            "integrity_failures": ts.integrity_failures,
            "leases": sum(1 for le in self._leases.values() if le.tenant_id == ts.tenant_id),
            "reservations": sum(
                1 for r in self._reservations.values() if r.tenant_id == ts.tenant_id
            ),
            "tiers": tiers,
        }

    # --- what is cached (dpuctl chunks) --------------------------------------------------
    def chunks(self, tenant: str, *, limit: int, after: bytes = b"") -> list[dict[str, Any]]:
        """A page of the tenant's chunks in key order, those after key `after` (b"": from the
        start): key, tier, size, checksum, times, use counts."""
        assert 0 < limit <= CHUNKS_PAGE_MAX, limit
        with self._lock:
            ts = self._tenant(tenant)
            cols = self._index.cols
            live = self._index.live_rows()
            rows = live[cols["tenant"][live] == ts.tenant_id]
            # key order = the bytes' order: compare the little-endian words byte-swapped
            hi, lo = cols["k0"][rows].byteswap(), cols["k1"][rows].byteswap()
            rows = rows[np.lexsort((lo, hi))]
            if after:
                a_hi = int.from_bytes(after[:8], "big")
                a_lo = int.from_bytes(after[8:16], "big")
                hi, lo = cols["k0"][rows].byteswap(), cols["k1"][rows].byteswap()
                rows = rows[(hi > a_hi) | ((hi == a_hi) & (lo > a_lo))]
            return [self._chunk_row(ts, int(r)) for r in rows[:limit]]

    def chunk(self, tenant: str, key: bytes) -> dict[str, Any]:
        """One chunk's record; UnknownKey when the tenant has no chunk under `key`."""
        _check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._index.find(ts.tenant_id, key)
            if row == NO_ROW:
                raise UnknownKey(f"tenant {tenant!r} has no chunk {key.hex()}")
            return self._chunk_row(ts, row)

    def _chunk_row(self, ts: TenantState, row: int) -> dict[str, Any]:
        c = self._index.cols
        tier = ts.tiers[int(c["tier"][row])]
        checksum = int(c["c0"][row]).to_bytes(8, "little") + int(c["c1"][row]).to_bytes(8, "little")
        idle_s = max(0.0, self._clock() - self._epoch - float(c["last_access"][row]))
        return {
            "key": self._index.key_of(row).hex(),
            "tier": tier.spec.name,
            "length_bytes": int(c["length"][row]),
            "block_count": int(c["block_count"][row]),
            "lba": int(c["lba"][row]),
            "checksum": checksum.hex(),
            "generation": int(c["generation"][row]),
            "created": int(c["created"][row]),
            "idle_s": round(idle_s, 3),
            "access_count": int(c["access_count"][row]),
            "pins": int(c["pin"][row]),
            "leases": int(c["lease"][row]),
        }

    def _update_gauges(self) -> None:
        for ts in self._tenants.values():
            for tier in ts.tiers:
                _USED.labels(ts.name, tier.spec.name).set(tier.alloc.used_blocks * BLOCK_SIZE)
                _RECORDS.labels(ts.name, tier.spec.name).set(tier.records)

    # --- housekeeping and durability -------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Expire reservations and leases, group-commit the journal, checkpoint when due."""
        with self._lock:
            self._check_open()
            now = self._clock()
            reservations, leases = self._expire(now)
            if self._fence is not None:
                self._try_lift_fence()
            synced = now - self._last_sync >= self.config.fsync_interval_s
            if synced:
                self._last_sync = now
            due = self._journal.segment_bytes >= self.config.checkpoint_wal_bytes
            due = due and self._fence is None
            self._update_gauges()
        if synced:
            self._sync()  # outside the lock: lookups go on while the disk flushes
        demoted = self._background_demote() if self._fence is None else 0
        promoted = self._background_promote() if self._fence is None else 0
        if due:
            self.checkpoint()
        return {
            "reservations_expired": reservations,
            "leases_expired": leases,
            "demoted": demoted,
            "promoted": promoted,
            "synced": int(synced),
            "checkpointed": int(due),
        }

    # --- background demotion: data copied outside the lock ---------------------------------

    def _background_demote(self) -> int:
        """Demote DRAM chunks until each tenant's DRAM has its free target; returns the count."""
        return self._demote_outside_lock(DEMOTIONS_PER_TICK_MAX, DEMOTION_BYTES_PER_TICK_MAX)

    def persist_dram(self) -> dict[str, int]:
        """Move every DRAM chunk to NVMe where NVMe has free room (evicting nothing), one chunk
        at a time with the data copied outside the lock: what a backup runs first, since DRAM
        is volatile and a backup holds the persistent tier. `left`: chunks still only in DRAM
        (leased meanwhile, or no room)."""
        with self._lock:
            self._check_open()
            before = sum(ts.tiers[DRAM].records for ts in self._tenants.values())
        moved = self._demote_outside_lock(before, 1 << 62, persist=True) if before else 0
        with self._lock:
            left = sum(ts.tiers[DRAM].records for ts in self._tenants.values())
        return {"moved": moved, "left": left}

    def _demote_outside_lock(self, jobs_max: int, bytes_max: int, *, persist: bool = False) -> int:
        moved = copied = 0
        for _ in range(jobs_max):
            if copied >= bytes_max:
                break
            with self._lock:
                job = self._start_demotion(persist=persist)
            if job is None:
                break
            try:
                ok = self._copy_demotion(job)
            except BlockDeviceError as e:  # a tier's device failed (SPDK mode: a lost link)
                with self._lock:
                    self._unlease(job.lease)
                    job.ts.tiers[NVME].alloc.free(job.dst, job.block_count)
                log.warning("engine.demotion_failed", tenant=job.ts.name, error=str(e))
                break  # the chunk stays in DRAM; the next tick tries again
            copied += job.block_count * BLOCK_SIZE
            with self._lock:
                try:
                    moved += self._finish_demotion(job, ok)
                except JournalUnavailable:
                    break  # fenced; the chunk stays in DRAM
        return moved

    def _start_demotion(self, *, persist: bool = False) -> _Demotion | None:
        """Pick a DRAM victim of a tenant below its free target, lease it, allocate on NVMe.
        `persist`: any tenant's DRAM chunk, into free NVMe room only (nothing evicted)."""
        now = self._clock()
        for ts in self._tenants.values():
            dram = ts.tiers[DRAM]
            target = int(dram.alloc.block_count * self.config.dram_free_fraction)
            if dram.alloc.free_blocks >= target and not persist:
                continue
            row = self._victim(dram, now)
            if row is None:
                continue
            cols = self._index.cols
            n, src = int(cols["block_count"][row]), int(cols["lba"][row])
            dst = self._make_room(ts, NVME, n, now, evict=not persist)
            if dst is None and persist:  # this tenant's NVMe is full: its DRAM chunks stay
                if self._item(row) not in dram.policy:  # a recovered one off the cold list
                    self._policy_insert(dram, row, now)  # stays evictable
                continue
            if dst is None:
                self._drop(ts, row)  # NVMe has no room at all: an ordinary eviction
                ts.evictions += 1
                continue
            self._lease_extent(ts.tenant_id, DRAM, src, row)
            lease = Lease(
                lease_id=0,
                tenant_id=ts.tenant_id,
                extents=[(DRAM, src, n, row)],
                expires=float("inf"),
            )
            return _Demotion(
                ts=ts,
                row=row,
                seq=int(cols["seq"][row]),
                key=self._index.key_of(row),
                checksum=self._checksum(row),
                src=src,
                dst=dst,
                block_count=n,
                length=int(cols["length"][row]),
                lease=lease,
            )
        return None

    def _copy_demotion(self, job: _Demotion) -> bool:
        buf = bytearray(job.block_count * BLOCK_SIZE)
        job.ts.tiers[DRAM].device.read_into(job.src, memoryview(buf))
        if chunk_checksum(job.key, memoryview(buf)[: job.length]) != job.checksum:
            return False
        job.ts.tiers[NVME].device.write(job.dst, memoryview(buf))
        return True

    def _finish_demotion(self, job: _Demotion, ok: bool) -> int:
        """Switch the record to NVMe, unless it changed or a reader leased it meanwhile."""
        ts, row, cols = job.ts, job.row, self._index.cols
        self._unlease(job.lease)
        same = cols["state"][row] == STATE_LIVE and int(cols["seq"][row]) == job.seq
        if not same or cols["lease"][row] or not ok:
            ts.tiers[NVME].alloc.free(job.dst, job.block_count)
            if same and not ok:
                self._integrity_failure(ts, row)
            return 0
        generation = ts.tiers[NVME].devices.key_generation
        try:
            seq = self._journal_move(ts, row, NVME, job.dst, generation)  # journal first
        except JournalUnavailable:
            ts.tiers[NVME].alloc.free(job.dst, job.block_count)
            raise
        self._untrack(ts, DRAM, row)
        ts.tiers[DRAM].alloc.free(job.src, job.block_count)
        cols["tier"][row] = NVME
        cols["lba"][row] = job.dst
        cols["generation"][row] = generation
        cols["seq"][row] = seq
        self._track(ts, NVME, row, self._clock())
        ts.demotions += 1
        _EVICTIONS.labels(ts.name, "dram", "demote").inc()
        return 1

    # --- background promotion: hot NVMe chunks back to DRAM, copied outside the lock ----------

    def _background_promote(self) -> int:
        """Move NVMe chunks read twice within PROMOTE_REREAD_S (since the last scan) to free
        DRAM, hottest first; returns the count. Promotions use DRAM's free space only, keeping
        half of the `dram_free_fraction` target for writes; the next tick's demotion restores
        the target by demoting the DRAM policy's victims."""
        with self._lock:
            candidates = self._promotion_candidates()
        moved = copied = 0
        for row, seq in candidates:
            if copied >= PROMOTION_BYTES_PER_TICK_MAX:
                break
            with self._lock:
                job = self._start_promotion(row, seq)
            if job is None:
                continue
            try:
                ok = self._copy_promotion(job)
            except BlockDeviceError as e:  # a tier's device failed: the chunk stays on NVMe
                with self._lock:
                    self._unlease(job.lease)
                    job.ts.tiers[DRAM].alloc.free(job.dst, job.block_count)
                log.warning("engine.promotion_failed", tenant=job.ts.name, error=str(e))
                break
            copied += job.block_count * BLOCK_SIZE
            with self._lock:
                try:
                    moved += self._finish_promotion(job, ok)
                except JournalUnavailable:
                    break  # fenced; the chunk stays on NVMe
        return moved

    def _promotion_candidates(self) -> list[tuple[int, int]]:
        """(row, seq) of the NVMe chunks that turned hot since the last scan, hottest first."""
        self._check_open()
        cols = self._index.cols
        since, self._promote_since = self._promote_since, self._clock() - self._epoch
        live = self._index.live_rows()
        rows = live[cols["tier"][live] == NVME]
        last, prev = cols["last_access"][rows], cols["prev_access"][rows]
        hot = (last >= since) & (cols["access_count"][rows] >= 2)
        hot &= last - prev <= PROMOTE_REREAD_S
        rows = rows[hot]
        rows = rows[np.argsort(-cols["last_access"][rows], kind="stable")]
        rows = rows[:PROMOTIONS_PER_TICK_MAX]
        return list(zip(rows.tolist(), cols["seq"][rows].tolist(), strict=True))

    def _start_promotion(self, row: int, seq: int) -> _Promotion | None:
        """Lease the NVMe extent and allocate free DRAM for it; None if it changed or no room."""
        cols = self._index.cols
        if cols["state"][row] != STATE_LIVE or int(cols["seq"][row]) != seq:
            return None  # deleted, replaced or moved since the scan
        ts = self._by_id[int(cols["tenant"][row])]
        dram = ts.tiers[DRAM]
        n, src = int(cols["block_count"][row]), int(cols["lba"][row])
        keep = int(dram.alloc.block_count * self.config.dram_free_fraction) // 2
        if n > dram.alloc.block_count // SMALL_FRACTION or dram.alloc.free_blocks < n + keep:
            return None  # placement: only small chunks go to DRAM, and only into free room
        dst = dram.alloc.alloc(n)
        if dst is None:
            return None  # free, but fragmented
        self._lease_extent(ts.tenant_id, NVME, src, row)
        lease = Lease(
            lease_id=0, tenant_id=ts.tenant_id, extents=[(NVME, src, n, row)], expires=float("inf")
        )
        return _Promotion(ts=ts, row=row, seq=seq, key=self._index.key_of(row),
                          checksum=self._checksum(row), src=src, dst=dst, block_count=n,
                          length=int(cols["length"][row]), lease=lease)  # fmt: skip

    def _copy_promotion(self, job: _Promotion) -> bool:
        buf = bytearray(job.block_count * BLOCK_SIZE)
        job.ts.tiers[NVME].device.read_into(job.src, memoryview(buf))
        if chunk_checksum(job.key, memoryview(buf)[: job.length]) != job.checksum:
            return False
        job.ts.tiers[DRAM].device.write(job.dst, memoryview(buf))
        return True

    def _finish_promotion(self, job: _Promotion, ok: bool) -> int:
        """Switch the record to DRAM unless it changed meanwhile. Readers that leased the NVMe
        extent keep it: it is freed when their last lease ends (the deferred release)."""
        ts, row, cols = job.ts, job.row, self._index.cols
        self._unlease(job.lease)
        same = cols["state"][row] == STATE_LIVE and int(cols["seq"][row]) == job.seq
        if not same or not ok:
            ts.tiers[DRAM].alloc.free(job.dst, job.block_count)
            if same and not ok:
                self._integrity_failure(ts, row)  # quarantines the NVMe extent
            return 0
        # DRAM is volatile: the persistent record ends here (a restart must not find it
        # pointing at NVMe blocks that are reused); close() demotes DRAM chunks back. Journal
        # first: if it cannot be written, nothing changes (and writes are fenced).
        try:
            self._wal(pack_delete(ts.tenant_id, self._next_seq(), job.key))
        except JournalUnavailable:
            ts.tiers[DRAM].alloc.free(job.dst, job.block_count)
            raise
        self._untrack(ts, NVME, row)
        k = (ts.tenant_id, NVME, job.src)
        if k in self._extent_leases:
            self._deferred[k] = (job.block_count, False)
            cols["lease"][row] = 0  # every lease on the row was on the NVMe extent
        else:
            ts.tiers[NVME].alloc.free(job.src, job.block_count)
        cols["tier"][row] = DRAM
        cols["lba"][row] = job.dst
        cols["generation"][row] = ts.tiers[DRAM].devices.key_generation
        cols["seq"][row] = self._next_seq()
        self._track(ts, DRAM, row, self._clock())
        ts.promotions += 1
        _EVICTIONS.labels(ts.name, "nvme", "promote").inc()
        return 1

    def _sync(self) -> None:
        """Chunk data first, then the journal: a synced commit never points at unsynced data.
        Runs without the engine lock (fsync of a big dirty file takes a while); a failure
        fences writes: what the kernel failed to write may be gone."""
        with self._lock:
            devices = [ts.tiers[NVME].device for ts in self._tenants.values()]
        try:
            for dev in devices:
                dev.flush()
            self._journal.sync()
        except (BlockDeviceError, OSError, JournalError) as e:
            err = e if isinstance(e, JournalError) else JournalError(str(e), _errno_of(e))
            with self._lock:
                self._set_fence(err)

    def _try_lift_fence(self) -> None:
        """Probe the journal (cut back, write, fsync, cut back); lift the fence if it works."""
        try:
            self._journal.probe()
        except JournalError as e:
            self._fence = e
            return
        self._lift_fence()

    def checkpoint(self) -> dict[str, Any]:
        """Snapshot the persistent records, then drop the WAL segments the snapshot contains.
        JournalUnavailable (writes fenced) when the checkpoint cannot be written."""
        with self._checkpoint_lock:
            t0 = time.perf_counter()
            with self._lock:
                self._check_open()
                self._check_writable()
                try:
                    columns, meta = recovery.snapshot(self)
                except JournalError as e:  # the next segment could not be opened
                    self._set_fence(e)
                    raise self._unavailable(e) from e
                devices = [ts.tiers[NVME].device for ts in self._tenants.values()]
            try:
                for dev in devices:
                    dev.flush()
                size = self._journal.write_checkpoint(columns, meta)
            except (BlockDeviceError, JournalError) as e:
                err = e if isinstance(e, JournalError) else JournalError(str(e), _errno_of(e))
                with self._lock:
                    self._set_fence(err)
                raise self._unavailable(err) from e
            seconds = time.perf_counter() - t0
            log.info(
                "engine.checkpoint", records=len(columns["k0"]), bytes=size, s=round(seconds, 3)
            )
            return {
                "records": len(columns["k0"]),
                "bytes": size,
                "seconds": seconds,
                "segment": meta["segment"],
            }

    def close(self) -> None:
        """Demote DRAM chunks to NVMe where room allows, checkpoint, close devices."""
        with self._lock:
            if self._closed:
                return
            if self._fence is not None:
                self._try_lift_fence()
            try:
                moved = self._demote_all_dram()
            except (BlockDeviceError, JournalUnavailable) as e:  # DRAM chunks not moved are lost
                moved = 0
                log.warning("engine.close_demotion_failed", error=str(e))
        try:
            self.checkpoint()
        except EngineError as e:  # no checkpoint: the WAL keeps every commit, restart replays
            log.warning("engine.close_checkpoint_failed", error=str(e))
        with self._lock:
            try:
                self._journal.close()
            except JournalError as e:  # the last fsync failed: a power loss may cost the tail
                log.error("engine.close_journal_sync_failed", error=str(e))
            for ts in self._tenants.values():
                for tier in ts.tiers:
                    tier.device.close()
            self._closed = True
        log.info("engine.closed", dram_chunks_kept=moved)

    def _demote_all_dram(self) -> int:
        """DRAM is volatile: move what fits into free NVMe space, hottest first."""
        now = self._clock()
        cols = self._index.cols
        live = self._index.live_rows()
        dram = live[cols["tier"][live] == DRAM]
        order = dram[np.argsort(-cols["last_access"][dram], kind="stable")]
        moved = 0
        for row in order.tolist():
            ts = self._by_id[int(cols["tenant"][row])]
            if cols["lease"][row]:
                continue
            if self._demote(ts, row, now, evict=False):
                moved += 1
        return moved

    # --- backup ----------------------------------------------------------------------------

    def backup(self, dest_dir: str | Path, incremental: bool = False) -> dict[str, Any]:
        """Full or incremental backup of the persistent tier's chunks (ciphertext) and records;
        DRAM chunks are moved to NVMe first where there is room, and the result counts those
        that could not be (`dram_only_chunks`: not in the backup)."""
        persisted = self.persist_dram()
        result = backup_mod.backup(self, Path(dest_dir), incremental=incremental)
        moved, left = persisted["moved"], persisted["left"]
        return {**result, "dram_persisted": moved, "dram_only_chunks": left}

    def restore(self, backup_dirs: Sequence[str | Path]) -> dict[str, Any]:
        """Load a full backup then its incrementals (oldest first) into this fresh engine."""
        return backup_mod.restore(self, [Path(d) for d in backup_dirs])


def _errno_of(e: BaseException) -> int | None:
    """The OS error number behind a device error (its cause), if any."""
    cur: BaseException | None = e
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur.errno
        cur = cur.__cause__ or cur.__context__
    return None
