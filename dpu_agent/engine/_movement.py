"""Data movement between tiers: demotion (DRAM -> NVMe) and promotion (hot NVMe -> DRAM).

The background paths copy each chunk outside the engine lock: under the lock a job picks a
chunk, leases its source extent (nothing frees or reuses it meanwhile) and allocates the
destination; the copy (read, verify, write) runs unlocked; under the lock again the record
switches tiers, journal first, unless it changed or the copy failed. Only the close-time
flush (`demote_all_dram`, inline `demote`) copies under the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE, BlockDeviceError
from dpu_agent.engine import journal as jr
from dpu_agent.engine._commit import CommitLog
from dpu_agent.engine._leases import Leases
from dpu_agent.engine._placement import EVICTIONS, SMALL_FRACTION, Placement
from dpu_agent.engine._records import Records
from dpu_agent.engine._tenants import Tenants
from dpu_agent.engine.errors import JournalUnavailable
from dpu_agent.engine.index import STATE_LIVE
from dpu_agent.engine.tiers import DRAM, NVME
from dpu_agent.engine.types import EngineConfig, Lease, TenantState
from dpu_agent.log import get_logger
from kvproto.checksum import chunk_checksum

__all__ = ["PROMOTE_REREAD_S", "Mover"]

log = get_logger(__name__)

DEMOTIONS_PER_TICK_MAX = 256  # bounds one tick's work; the next tick goes on
DEMOTION_BYTES_PER_TICK_MAX = 256 << 20  # ~0.1-0.2 s of copying (XTS + checksum) per tick
PROMOTIONS_PER_TICK_MAX = 256  # as for demotions: bounds one tick's work, the next goes on
PROMOTION_BYTES_PER_TICK_MAX = 128 << 20  # NVMe reads at ~1.4 GB/s: under 0.1 s per tick
# After each chunk a background loop sleeps this long (0: just yield). Neither the engine lock
# nor the GIL is fair: a loop that drops both and takes them straight back kept a waiting
# lookup out for up to the interpreter's 5 ms switch interval (docs/BENCHMARKS.md, "lookup
# during sync": p99 2.5 -> 1.3 ms with the yield, interleaved runs).
YIELD_S = 0.0
# Hot: read at least twice, the last two reads at most this far apart (LRU-2's test of a
# second reference); a conversation's think time is tens of seconds
PROMOTE_REREAD_S = 60.0


@dataclass(slots=True, kw_only=True)
class _Move:
    """A chunk being copied between tiers outside the lock (its source extent leased)."""

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


class Mover:
    """Demotes and promotes chunks. Owns the time of the last promotion scan; takes and drops
    the engine lock itself in the background paths (`background_demote`, `persist_dram`,
    `background_promote`: call them without it); `demote`, `demote_all_dram`, `start_demotion`
    and `finish_demotion` are called with it held."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        config: EngineConfig,
        tenants: Tenants,
        records: Records,
        leases: Leases,
        placement: Placement,
        commit: CommitLog,
        clock: Callable[[], float],
        epoch: float,
        check_open: Callable[[], None],
    ) -> None:
        self._lock, self._config, self._tenants = lock, config, tenants
        self._records, self._leases, self._placement = records, leases, placement
        self._commit, self._clock, self._epoch = commit, clock, epoch
        self._check_open = check_open
        self.promote_since = 0.0  # engine-clock time of the last promotion scan

    # --- demotion under the lock (close) -------------------------------------------------------

    def demote(self, ts: TenantState, row: int, now: float, *, evict: bool) -> bool:
        """Move a DRAM chunk to NVMe (verifying it); False when NVMe has no room for it. The
        NVMe extent goes back if the write or the journal fails (then the error is raised)."""
        cols = self._records.index.cols
        n, src = int(cols["block_count"][row]), int(cols["lba"][row])
        length = int(cols["length"][row])
        dst = self._placement.make_room(ts, NVME, n, now, evict=evict)
        if dst is None:
            return False
        buf = bytearray(n * BLOCK_SIZE)
        key = self._records.index.key_of(row)
        generation = ts.tiers[NVME].devices.key_generation
        try:
            ts.tiers[DRAM].device.read_into(src, memoryview(buf))
            if chunk_checksum(key, memoryview(buf)[:length]) != self._records.checksum(row):
                ts.tiers[NVME].alloc.free(dst, n)
                self._records.integrity_failure(ts, row)
                return True
            ts.tiers[NVME].device.write(dst, memoryview(buf))
            seq = self._records.journal_move(ts, row, NVME, dst, generation)
        except BaseException:
            ts.tiers[NVME].alloc.free(dst, n)
            raise
        self._to_nvme(ts, row, src, dst, n, generation, seq, now)
        return True

    def _to_nvme(self, ts: TenantState, row: int, src: int, dst: int, n: int, generation: int,
                 seq: int, now: float) -> None:  # fmt: skip
        """Switch a journaled demotion's record to its NVMe extent; free the DRAM one."""
        cols = self._records.index.cols
        self._records.untrack(ts, DRAM, row)
        ts.tiers[DRAM].alloc.free(src, n)
        cols["tier"][row] = NVME
        cols["lba"][row] = dst
        cols["generation"][row] = generation
        cols["seq"][row] = seq
        self._records.track(ts, NVME, row, now)
        ts.demotions += 1
        EVICTIONS.labels(ts.name, "dram", "demote").inc()

    def demote_all_dram(self) -> int:
        """DRAM is volatile: move what fits into free NVMe space, hottest first."""
        now = self._clock()
        index = self._records.index
        cols = index.cols
        live = index.live_rows()
        dram = live[cols["tier"][live] == DRAM]
        order = dram[np.argsort(-cols["last_access"][dram], kind="stable")]
        moved = 0
        for row in order.tolist():
            ts = self._tenants.by_id(int(cols["tenant"][row]))
            if cols["lease"][row]:
                continue
            if self.demote(ts, row, now, evict=False):
                moved += 1
        return moved

    # --- background demotion: data copied outside the lock -------------------------------------

    def background_demote(self) -> int:
        """Demote DRAM chunks until each tenant's DRAM has its free target; returns the count."""
        return self._demote_outside_lock(DEMOTIONS_PER_TICK_MAX, DEMOTION_BYTES_PER_TICK_MAX)

    def persist_dram(self) -> dict[str, int]:
        """Move every DRAM chunk to NVMe where NVMe has free room (evicting nothing); `left`:
        chunks still only in DRAM (leased meanwhile, or no room)."""
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
                job = self.start_demotion(persist=persist)
            if job is None:
                break
            done = self._move_one(job, DRAM, NVME, self.finish_demotion)
            if done is None:
                break  # the chunk stays in DRAM; the next tick tries again
            moved += done
            copied += job.block_count * BLOCK_SIZE
        return moved

    def _move_one(
        self, job: _Move, src_tier: int, dst_tier: int, finish: Callable[[_Move, bool], int]
    ) -> int | None:
        """Copy one chunk outside the lock, then `finish` it under the lock; 1 if it moved, 0
        if not, None when the loop must stop: a tier's device failed (SPDK mode: a lost link)
        or writes are fenced. The chunk then stays where it was."""
        try:
            ok = self.copy(job, src_tier, dst_tier)
        except BlockDeviceError as e:
            with self._lock:
                self._leases.unlease(job.lease)
                job.ts.tiers[dst_tier].alloc.free(job.dst, job.block_count)
            what = "demotion" if dst_tier == NVME else "promotion"
            log.warning(f"engine.{what}_failed", tenant=job.ts.name, error=str(e))
            return None
        try:
            with self._lock:
                done = finish(job, ok)
        except JournalUnavailable:
            return None  # fenced
        time.sleep(YIELD_S)  # let a waiting lookup in (see YIELD_S)
        return done

    def start_demotion(self, *, persist: bool = False) -> _Move | None:
        """Pick a DRAM victim of a tenant below its free target, lease it, allocate on NVMe.
        `persist`: any tenant's DRAM chunk, into free NVMe room only (nothing evicted)."""
        now = self._clock()
        cols = self._records.index.cols
        for ts in self._tenants.values():
            dram = ts.tiers[DRAM]
            target = int(dram.alloc.block_count * self._config.dram_free_fraction)
            if dram.alloc.free_blocks >= target and not persist:
                continue
            row = self._records.victim(dram, now)
            if row is None:
                continue
            n, src = int(cols["block_count"][row]), int(cols["lba"][row])
            dst = self._placement.make_room(ts, NVME, n, now, evict=not persist)
            if dst is None and persist:  # this tenant's NVMe is full: its DRAM chunks stay
                # a recovered one off the cold list
                if self._records.item(dram, row) not in dram.policy:
                    self._records.policy_insert(dram, row, now)  # stays evictable
                continue
            if dst is None:
                self._records.drop(ts, row)  # NVMe has no room at all: an ordinary eviction
                ts.evictions += 1
                continue
            return self._start(ts, row, DRAM, src, dst, n, int(cols["seq"][row]))
        return None

    def _start(self, ts: TenantState, row: int, t: int, src: int, dst: int, n: int,
               seq: int) -> _Move:  # fmt: skip
        """Lease the source extent (tier `t`) and describe the copy."""
        cols = self._records.index.cols
        self._leases.lease_extent(ts.tenant_id, t, src, row)
        lease = Lease(lease_id=0, tenant_id=ts.tenant_id, extents=[(t, src, n, row)],
                      expires=float("inf"))  # fmt: skip
        return _Move(ts=ts, row=row, seq=seq, key=self._records.index.key_of(row),
                     checksum=self._records.checksum(row), src=src, dst=dst, block_count=n,
                     length=int(cols["length"][row]), lease=lease)  # fmt: skip

    @staticmethod
    def copy(job: _Move, src_tier: int, dst_tier: int) -> bool:
        """Read, verify and write one chunk (no lock needed: both extents are the job's).
        False when the source fails its checksum."""
        buf = bytearray(job.block_count * BLOCK_SIZE)
        job.ts.tiers[src_tier].device.read_into(job.src, memoryview(buf))
        if chunk_checksum(job.key, memoryview(buf)[: job.length]) != job.checksum:
            return False
        job.ts.tiers[dst_tier].device.write(job.dst, memoryview(buf))
        return True

    def finish_demotion(self, job: _Move, ok: bool) -> int:
        """Switch the record to NVMe, unless it changed or a reader leased it meanwhile."""
        ts, row, cols = job.ts, job.row, self._records.index.cols
        self._leases.unlease(job.lease)
        same = cols["state"][row] == STATE_LIVE and int(cols["seq"][row]) == job.seq
        if not same or cols["lease"][row] or not ok:
            ts.tiers[NVME].alloc.free(job.dst, job.block_count)
            if same and not ok:
                self._records.integrity_failure(ts, row)
            return 0
        generation = ts.tiers[NVME].devices.key_generation
        try:
            seq = self._records.journal_move(ts, row, NVME, job.dst, generation)  # journal first
        except JournalUnavailable:
            ts.tiers[NVME].alloc.free(job.dst, job.block_count)
            raise
        self._to_nvme(ts, row, job.src, job.dst, job.block_count, generation, seq, self._clock())
        return 1

    # --- background promotion: hot NVMe chunks back to DRAM, copied outside the lock ----------

    def background_promote(self) -> int:
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
            done = self._move_one(job, NVME, DRAM, self._finish_promotion)
            if done is None:
                break  # the chunk stays on NVMe
            moved += done
            copied += job.block_count * BLOCK_SIZE
        return moved

    def _promotion_candidates(self) -> list[tuple[int, int]]:
        """(row, seq) of the NVMe chunks that turned hot since the last scan, hottest first."""
        self._check_open()
        index = self._records.index
        cols = index.cols
        since, self.promote_since = self.promote_since, self._clock() - self._epoch
        live = index.live_rows()
        rows = live[cols["tier"][live] == NVME]
        last, prev = cols["last_access"][rows], cols["prev_access"][rows]
        hot = (last >= since) & (cols["access_count"][rows] >= 2)
        hot &= last - prev <= PROMOTE_REREAD_S
        rows = rows[hot]
        rows = rows[np.argsort(-cols["last_access"][rows], kind="stable")]
        rows = rows[:PROMOTIONS_PER_TICK_MAX]
        return list(zip(rows.tolist(), cols["seq"][rows].tolist(), strict=True))

    def _start_promotion(self, row: int, seq: int) -> _Move | None:
        """Lease the NVMe extent and allocate free DRAM for it; None if it changed or no room."""
        cols = self._records.index.cols
        if cols["state"][row] != STATE_LIVE or int(cols["seq"][row]) != seq:
            return None  # deleted, replaced or moved since the scan
        ts = self._tenants.by_id(int(cols["tenant"][row]))
        dram = ts.tiers[DRAM]
        n, src = int(cols["block_count"][row]), int(cols["lba"][row])
        keep = int(dram.alloc.block_count * self._config.dram_free_fraction) // 2
        if n > dram.alloc.block_count // SMALL_FRACTION or dram.alloc.free_blocks < n + keep:
            return None  # placement: only small chunks go to DRAM, and only into free room
        dst = dram.alloc.alloc(n)
        if dst is None:
            return None  # free, but fragmented
        return self._start(ts, row, NVME, src, dst, n, seq)

    def _finish_promotion(self, job: _Move, ok: bool) -> int:
        """Switch the record to DRAM unless it changed meanwhile. Readers that leased the NVMe
        extent keep it: it is freed when their last lease ends (the deferred release)."""
        ts, row, cols = job.ts, job.row, self._records.index.cols
        self._leases.unlease(job.lease)
        same = cols["state"][row] == STATE_LIVE and int(cols["seq"][row]) == job.seq
        if not same or not ok:
            ts.tiers[DRAM].alloc.free(job.dst, job.block_count)
            if same and not ok:
                self._records.integrity_failure(ts, row)  # quarantines the NVMe extent
            return 0
        # DRAM is volatile: the persistent record ends here (a restart must not find it
        # pointing at NVMe blocks that are reused); close() demotes DRAM chunks back. Journal
        # first: if it cannot be written, nothing changes (and writes are fenced).
        try:
            self._commit.append(jr.pack_delete(ts.tenant_id, self._commit.next_seq(), job.key))
        except JournalUnavailable:
            ts.tiers[DRAM].alloc.free(job.dst, job.block_count)
            raise
        self._records.untrack(ts, NVME, row)
        if self._leases.release_extent(ts, NVME, job.src, job.block_count, quarantine=False):
            cols["lease"][row] = 0  # every lease on the row was on the NVMe extent
        cols["tier"][row] = DRAM
        cols["lba"][row] = job.dst
        cols["generation"][row] = ts.tiers[DRAM].devices.key_generation
        cols["seq"][row] = self._commit.next_seq()
        self._records.track(ts, DRAM, row, self._clock())
        ts.promotions += 1
        EVICTIONS.labels(ts.name, "nvme", "promote").inc()
        return 1
