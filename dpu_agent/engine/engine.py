"""The storage engine's public face: `Engine`, a thin facade over parts that each own their
state (docs/ENGINE.md, docs/ARCHITECTURE.md):

- `RecordIndex` (index.py): the records' columns and the key -> row table.
- `CommitLog` (_commit.py): the journal, the sequence counter, the write fence.
- `Tenants` (_tenants.py): each tenant's tiers (devices, allocators, policies), by name and id.
- `Leases` (_leases.py): leases, reservations, leased-extent counts, deferred extents.
- `Records` (_records.py): commit/drop/move a record, journal first; policy bookkeeping.
- `Placement` (_placement.py): the tier and extent of a new chunk, eviction for room, quotas.
- `Mover` (_movement.py): demotion and promotion between tiers.
- `Reads` (_reads.py): lookups and their counters; `_views.py`: stats and chunk listings.
- recovery.py and backup.py: start-up replay, checkpoint snapshots, backups.

Lock discipline. One re-entrant engine lock (`Engine._lock`) guards all mutable state of all
parts; part methods assume it is held, except where their docstring says they take it. What
runs outside it: chunk data I/O (hosts read and write blocks through the NVMe/TCP target with
no engine call; `put_chunk`/`get_chunk` drop the lock for their I/O), the fsync of the group
commit (`_sync`: devices, then the journal), the checkpoint's flush and write (a second lock,
`_checkpoint_lock`, keeps checkpoints apart), the copies of background demotion and promotion
(the Mover leases the source extent under the lock, copies unlocked, switches the record under
the lock again), and a backup's copy of its leased extents. A reserve never copies a chunk
(DRAM full: the chunk goes to NVMe); only close() flushes DRAM to NVMe under the lock. A
failure seen outside the lock (fsync, checkpoint write) is recorded under it (the fence).

Durability: the journal is written before the index changes, always; a journal error fences
writes until a probe in tick() passes, and reads go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice, BlockDeviceError
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import _restart_order as restart_order
from dpu_agent.engine import backup as backup_mod
from dpu_agent.engine import journal as jr
from dpu_agent.engine import recovery
from dpu_agent.engine._commit import CommitLog
from dpu_agent.engine._leases import COUNT_MAX, Leases
from dpu_agent.engine._movement import PROMOTE_REREAD_S, Mover
from dpu_agent.engine._placement import Placement
from dpu_agent.engine._reads import Reads, check_key, joined_keys
from dpu_agent.engine._records import _INTEGRITY, Records
from dpu_agent.engine._tenants import Tenants
from dpu_agent.engine._views import (
    CHUNKS_PAGE_MAX,
    STAT_TOTALS,
    chunk_row,
    chunks_page,
    tenant_stats,
)
from dpu_agent.engine.errors import (
    EngineError,
    JournalUnavailable,
    LimitExceeded,
    UnknownKey,
)
from dpu_agent.engine.index import NO_ROW, RecordIndex
from dpu_agent.engine.journal import JournalError
from dpu_agent.engine.tiers import DeviceFactory, EmbeddedDevices
from dpu_agent.engine.types import (
    ChunkLocation,
    EngineConfig,
    LookupResult,
    PendingReservation,
    Reservation,
    TenantState,
)
from dpu_agent.files import read_small_file
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Gauge
from kvproto.checksum import chunk_checksum
from kvproto.control import LOOKUP_KEYS_MAX, STATS_TENANTS_PAGE_MAX, TENANTS_MAX, valid_tenant_name

__all__ = ["CHUNKS_PAGE_MAX", "PROMOTE_REREAD_S", "Engine", "EngineState"]

log = get_logger(__name__)
# in the journal directory: written when close() finished, removed at start, so its absence at
# start means the previous run was killed (doctor and status say so)
CLEAN_STOP = "clean-stop"

# in the journal directory: each tier's eviction state a restart begins from (`elect`'s leader),
# written with every checkpoint, read at start; not part of the records (losing it costs a
# restart its leader, nothing else)
POLICY_STATE = "policy-state.json"
POLICY_STATE_BYTES_MAX = 1 << 20

CHUNK_BYTES_MAX = 1 << 30  # one chunk; a 1 GiB KV chunk is far above any real layout

_USED = Gauge(
    "kvtier_engine_tier_used_bytes",
    "Allocated bytes per tier",
    ["tenant", "tier"],
    registry=REGISTRY,
)
_RECORDS = Gauge(
    "kvtier_engine_records", "Committed chunks per tier", ["tenant", "tier"], registry=REGISTRY
)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineState:
    """The engine's state as a whole, for the modules that work on all of it at once (backup
    and restore, the cluster's anti-entropy snapshot): handed out by `Engine.locked()` and
    valid only inside it, under the engine lock. Everything else goes through Engine's
    methods."""

    index: RecordIndex
    tenants: Tenants
    records: Records
    leases: Leases
    commit: CommitLog
    clock: Callable[[], float]  # the engine's clock (time.monotonic unless a test gives one)
    epoch: float  # clock() at start: the index keeps times as seconds since it

    def tenant(self, name: str) -> TenantState:
        """The tenant's state, or UnknownTenant."""
        return self.tenants.get(name)

    def since_epoch(self) -> float:
        """Now, in the index's time base (what `last_access` counts in)."""
        return self.clock() - self.epoch


class Engine:
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
        self.config = config
        self._clock = clock
        self._wall = wall_clock
        self._epoch = clock()
        self._lock = threading.RLock()
        self._checkpoint_lock = threading.Lock()
        if device_factory is None:
            config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            keystore = keystore if keystore is not None else KeyStore(config.key_path)
            device_factory = EmbeddedDevices(
                config.nvme_path, keystore, writeback_after_bytes=config.writeback_after_bytes
            )
        self._last_sync = clock()  # the tick's group-commit schedule
        self._order_saved = clock()  # the tick's schedule for saving the eviction order
        self._closed = False
        self._policy_state_written: bytes | None = None  # what _write_policy_state last wrote
        self._index = RecordIndex()
        self._tenants = Tenants(config, device_factory)
        self._commit = CommitLog(config.journal_path)
        self._leases = Leases(self._index, self._tenants, self._commit)
        self._records = Records(self._index, self._commit, self._leases, epoch=self._epoch,
                                wall_clock=wall_clock)  # fmt: skip
        self._state = EngineState(index=self._index, tenants=self._tenants, records=self._records,
                                  leases=self._leases, commit=self._commit, clock=clock,
                                  epoch=self._epoch)  # fmt: skip
        self._placement = Placement(self._records, self._leases, clock)
        self._reads = Reads(self._records, self._leases, epoch=self._epoch,
                            lease_ttl_s=config.lease_ttl_s)  # fmt: skip
        self._mover = Mover(lock=self._lock, config=config, tenants=self._tenants,
                            records=self._records, leases=self._leases, placement=self._placement,
                            commit=self._commit, clock=clock, epoch=self._epoch,
                            check_open=self._check_open)  # fmt: skip
        try:
            clean_stop = self._commit.journal.dir / CLEAN_STOP
            stopped_cleanly = clean_stop.exists()
            report = recovery.recover(self._commit, self._tenants, self._index, config.tenants,
                                      clean_stop=stopped_cleanly)  # fmt: skip
            previous = report.previous_stop
            self.recovery_report = report
            clean_stop.unlink(missing_ok=True)  # from here a kill -9 is an unclean stop
            if previous == "unclean":
                log.warning("engine.previous_stop_unclean", records=report.records,
                            wal_records=report.wal_records)  # fmt: skip
            self._add_tenants(config.tenants)
            # what the policies held at the last save or the clean stop, before their own
            # state (_restart_order)
            restart_order.adopt_saved_order(
                self._tenants, self._records, self._commit.journal.dir,
                previous_stop=previous, now=clock(),
            )  # fmt: skip
        except BaseException:
            self._commit.journal.close()  # a failed start must not keep the directory locked
            raise
        self.restore_interrupted = backup_mod.interrupted_restore(config.data_dir)
        if self.restore_interrupted is not None:
            log.error("engine.restore_interrupted", **self.restore_interrupted,
                      fix="dpuctl backup restore --resume, or --rollback")  # fmt: skip
        self.restore_policies(self._read_policy_state())
        # agents older than the file, or a start after damage: the ids as recovered
        self._commit.save_tenant_ids(self._tenants.names_by_id(), soft=True)
        r = self.recovery_report
        if (r.torn_segments or r.damaged_frames or r.missing_segments or r.checkpoints_damaged
                or r.dropped_records):  # fmt: skip
            # a verified checkpoint of what survived, now: a later crash replays from it. On a
            # full disk it cannot land: start anyway (reads are served, writes fenced)
            try:
                self.checkpoint()
            except JournalUnavailable as e:
                log.error("engine.start_checkpoint_failed", error=str(e))

    # --- tenants ---------------------------------------------------------------------------

    def add_tenant(self, tenant: str, *, quota_bytes: int = 0) -> None:
        """Create the tenant's tiers (idempotent; an existing tenant gets the new quota)."""
        self._add_tenants({tenant: quota_bytes})

    def _add_tenants(self, tenants: Mapping[str, int]) -> None:
        """add_tenant of many at once: the new ones' keys and ids are written once for all
        (a start with thousands of new tenants rewrote both files for each: minutes)."""
        for tenant, quota_bytes in tenants.items():
            if not valid_tenant_name(tenant):
                raise ValueError(
                    f"tenant name {tenant!r} is invalid: use 1-63 lowercase letters, digits, '-'"
                )
            if quota_bytes < 0:
                raise ValueError(f"quota_bytes={quota_bytes}: give 0 (none) or a positive size")
        with self._lock:
            self._check_open()
            new: dict[str, int] = {}
            for tenant, quota_bytes in tenants.items():
                ts = self._tenants.find(tenant)
                if ts is not None:
                    ts.quota_bytes = quota_bytes
                else:
                    new[tenant] = quota_bytes
            if not new:
                return
            if len(self._tenants) + len(new) > TENANTS_MAX:
                raise LimitExceeded(f"{TENANTS_MAX} tenants exist; remove one first")
            ids = dict(zip(new, self._tenants.free_ids(len(new)), strict=True))
            self._commit.check_writable()
            self._tenants.prepare(list(new))
            # the ids' names on disk outside the WAL first: a damaged tenant frame costs nothing
            names = self._tenants.names_by_id()
            self._commit.save_tenant_ids({**names, **{t: n for n, t in ids.items()}}, soft=False)
            for tenant, quota_bytes in new.items():
                tid = ids[tenant]
                self._commit.append(jr.pack_tenant(tid, self._commit.next_seq(), tenant))
                self._tenants.build(tenant, tid, quota_bytes)
                log.info("engine.tenant_added", tenant=tenant, quota_bytes=quota_bytes)
            self._update_gauges()  # their series exist (at 0) from now, not from a first event

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._tenants)

    def namespaces(self, tenant: str) -> dict[int, BlockDevice]:
        """What the NVMe/TCP target exports for the tenant: nsid -> (encrypting) device."""
        with self._lock:
            ts = self._tenant(tenant)
            return {t.spec.nsid: t.device for t in ts.tiers}

    def write_gate(self, tenant: str) -> Callable[[int, int, int], bool]:
        """For the NVMe/TCP target: whether the tenant's hosts may write (nsid, lba, count):
        only inside its open reservations. A raw write elsewhere (a committed chunk, free
        blocks) escaped the quota and the index: a tenant with a 1 MiB quota filled its whole
        sparse file, and the disk under every tenant's. Called without the engine lock."""
        with self._lock:
            ts = self._tenant(tenant)
            tiers = {t.spec.nsid: (ts.tenant_id, i) for i, t in enumerate(ts.tiers)}
        writable = self._leases.writable

        def allowed(nsid: int, lba: int, count: int) -> bool:
            key = tiers.get(nsid)
            extents = writable.get(key) if key is not None else None
            return extents is not None and extents.covers(lba, count)

        return allowed

    def remove_tenant(self, tenant: str) -> dict[str, Any]:
        """Crypto-erase a tenant: journal its removal, forget its records, leases and
        reservations, close its devices, then destroy its XTS keys and delete its NVMe file
        (device factories that can: the embedded one). Its blocks are unreadable after this;
        a tenant added later under the same name gets a new key and starts empty."""
        with self._lock:
            ts = self._tenant(tenant)
            tid = ts.tenant_id
            self._commit.append(jr.pack_tenant_remove(tid, self._commit.next_seq()))
            cols = self._index.cols
            live = self._index.live_rows()
            rows = live[cols["tenant"][live] == tid]
            self._index.remove_many(rows)
            self._leases.forget_tenant(tid)
            self._reads.forget_tenant(tid)
            self._tenants.forget(ts)
            self._commit.save_tenant_ids(self._tenants.names_by_id(), soft=True)
        key_destroyed = self._tenants.erase(tenant)
        log.info("engine.tenant_removed", tenant=tenant, records=len(rows),
                 key_destroyed=key_destroyed)  # fmt: skip
        return {"records_dropped": len(rows), "key_destroyed": key_destroyed}

    @contextlib.contextmanager
    def locked(self, *, check_open: bool = True, writable: bool = False) -> Iterator[EngineState]:
        """The engine lock, held for the block, and its state (EngineState). `check_open`:
        EngineError if the engine is closed (False: only to give back what an earlier block
        took, e.g. leases); `writable`: EngineError if the journal refuses writes."""
        with self._lock:
            if check_open:
                self._check_open()
            if writable:
                self._commit.check_writable()
            yield self._state

    def _tenant(self, name: str) -> TenantState:
        """The open engine's tenant (lock held), or EngineError/UnknownTenant."""
        self._check_open()
        return self._tenants.get(name)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed; start a new Engine on the same data_dir")

    # --- reads: lookup and leases ----------------------------------------------------------

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lease: bool = True, count: bool = True
    ) -> LookupResult:
        """The longest cached prefix of `keys`, its extents leased until release() or TTL.
        `lease=False` is a probe: counters and access history move as for a read, but nothing
        is leased (lease_id None), so there is nothing to release and nothing to read under.
        `count=False`: a writer checking what is already stored; no hit or miss is counted
        (the keys it is about to write are not misses of any read)."""
        hits, lease_id, expires_s = self._lookup(
            tenant, keys, lease=lease, as_lists=False, count=count
        )
        return LookupResult(hits=hits, lease_id=lease_id, lease_expires_s=expires_s)

    def lookup_lists(
        self, tenant: str, keys: Sequence[bytes], *, lease: bool = True, count: bool = True
    ) -> tuple[list[list[Any]], int | None, float]:
        """lookup() as (hits, lease_id, lease_expires_s), each hit a list [key, nsid, lba,
        block_count, length, checksum]: the control plane's reply shape, with no ChunkLocation
        built per hit on its hot path (about 1.5 us each)."""
        return self._lookup(tenant, keys, lease=lease, as_lists=True, count=count)

    def _lookup(
        self, tenant: str, keys: Sequence[bytes], *, lease: bool, as_lists: bool, count: bool
    ) -> tuple[list[Any], int | None, float]:
        if len(keys) > LOOKUP_KEYS_MAX:
            raise LimitExceeded(f"lookup of {len(keys)} keys; split it into <= {LOOKUP_KEYS_MAX}")
        blob = joined_keys(keys)
        with self._lock:
            ts = self._tenant(tenant)
            now = self._clock()
            return self._reads.lookup(
                ts, keys, blob, now, lease=lease, as_lists=as_lists, count=count
            )

    def release(self, tenant: str, lease_id: int) -> None:
        """End a lease. Raises LeaseExpired when it was already reclaimed after its TTL."""
        with self._lock:
            ts = self._tenant(tenant)
            self._leases.release(ts, lease_id, self._clock)

    # --- writes: reserve and commit --------------------------------------------------------

    def reserve(
        self, tenant: str, key: bytes, length: int, parent: bytes | None = None
    ) -> Reservation:
        """Allocate blocks for a chunk of `length` bytes (evicting if needed)."""
        check_key(key)
        if parent is not None:
            check_key(parent, "parent key")
        if not 0 < length <= CHUNK_BYTES_MAX:
            raise ValueError(f"chunk length {length}: give 1..{CHUNK_BYTES_MAX} bytes")
        n = -(-length // BLOCK_SIZE)
        with self._lock:
            ts = self._tenant(tenant)
            self._commit.check_writable()  # no point writing blocks a commit could not journal
            now = self._clock()
            self._leases.check_reservation_room(ts.tenant_id, now)
            self._placement.enforce_quota(ts, n)
            keep = NO_ROW if parent is None else self._index.find(ts.tenant_id, parent)
            tier, lba = self._placement.place(ts, n, length, now, keep)
            res = PendingReservation(
                reservation_id=self._leases.next_id(),
                tenant_id=ts.tenant_id,
                key=bytes(key),
                length=length,
                parent=None if parent is None else bytes(parent),
                tier=tier,
                lba=lba,
                block_count=n,
                expires=now + self.config.reservation_ttl_s,
            )
            self._leases.add_reservation(res)
            return Reservation(
                reservation_id=res.reservation_id,
                nsid=tier + 1,
                lba=lba,
                block_count=n,
                expires_s=self.config.reservation_ttl_s,
            )

    def commit(self, tenant: str, reservation_id: int, checksum: bytes) -> ChunkLocation:
        """Make a reserved chunk visible (replacing an older chunk under the same key)."""
        if len(checksum) != 16:
            raise ValueError(f"checksum must be 16 bytes (xxh3-128), got {len(checksum)}")
        with self._lock:
            ts = self._tenant(tenant)
            now = self._clock()
            res = self._take_reservation(ts, reservation_id, now)
            try:
                old = self._index.find(ts.tenant_id, res.key)
                if old != NO_ROW:
                    self._records.drop(ts, old)
                row = self._records.insert(ts, res, bytes(checksum), now)
            except JournalUnavailable:  # not journaled, so not committed: the blocks go back
                self._leases.reclaim_reservation(res)
                raise
            ts.reserved_blocks -= res.block_count
            return self._records.location(row, res.key)

    def abort(self, tenant: str, reservation_id: int) -> None:
        """Give a reservation back without committing it."""
        with self._lock:
            ts = self._tenant(tenant)
            res = self._take_reservation(ts, reservation_id, self._clock())
            self._leases.reclaim_reservation(res)

    def _take_reservation(self, ts: TenantState, rid: int, now: float) -> PendingReservation:
        return self._leases.take_reservation(ts, rid, now, self.config.reservation_ttl_s)

    # --- record operations -----------------------------------------------------------------

    def delete(self, tenant: str, key: bytes) -> None:
        check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            self._records.drop(ts, self._row_of(ts, key, "delete"))

    def pin(self, tenant: str, key: bytes) -> None:
        """Keep a chunk from eviction and demotion until unpin() (pins do not survive restart)."""
        check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._row_of(ts, key, "pin")
            if self._index.cols["pin"][row] >= COUNT_MAX:
                raise LimitExceeded(f"chunk {key.hex()} already has {COUNT_MAX} pins")
            self._index.cols["pin"][row] += 1

    def unpin(self, tenant: str, key: bytes) -> None:
        check_key(key)
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
                if not self._placement.drop_one(ts):
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
                        t, seq = tier.spec.index, self._commit.next_seq()
                        self._commit.append(
                            jr.pack_extent(jr.OP_UNQUARANTINE, ts.tenant_id, seq, t, lba, n)
                        )
                    del tier.quarantined[lba]
                    tier.alloc.free(lba, n)
                    released += n
            return released

    def report_corrupt(self, tenant: str, key: bytes) -> bool:
        """A reader found the chunk under `key` failing its checksum: drop the record and
        quarantine its extent (never reused until clear_quarantine), counted as an integrity
        failure. False when the tenant has no such chunk (already gone)."""
        check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._index.find(ts.tenant_id, key)
            if row == NO_ROW:
                return False
            self._records.integrity_failure(ts, row)
            return True

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
            same = same and self._records.checksum(row) == loc.checksum  # not a newer version
            if same and int(cols["tier"][row]) == loc.nsid - 1:
                self._records.integrity_failure(ts, row)
        return None

    # --- stats and what is cached (dpuctl chunks) --------------------------------------------

    def stats(
        self, tenant: str | None = None, *, after: str = "", limit: int = STATS_TENANTS_PAGE_MAX
    ) -> dict[str, Any]:
        """One tenant's stats, or the engine's: totals over every tenant, and the per-tenant
        rows of at most `limit` tenants in name order after `after` (`tenants_next`: the name
        to ask after for the next page, "" when this page is the last). Every tenant's rows
        would not fit one control frame at TENANTS_MAX."""
        with self._lock:
            if tenant is not None:
                return tenant_stats(self._tenant(tenant), self._leases)
            self._check_open()
            every = {name: tenant_stats(ts, self._leases) for name, ts in self._tenants.items()}
            totals = {k: sum(int(s[k]) for s in every.values()) for k in STAT_TOTALS}
            names = sorted(n for n in every if n > after)
            page = names[: max(0, limit)]
            fence = self._commit.fence
            return {
                **totals,
                "tenants": {name: every[name] for name in page},
                "tenants_next": page[-1] if len(names) > len(page) and page else "",
                "tenants_count": len(every),
                "leases": len(self._leases.leases),
                "reservations": len(self._leases.reservations),
                "index_bytes": self._index.nbytes,
                "journal_segment": self._commit.journal.segment,
                "journal_segment_bytes": self._commit.journal.segment_bytes,
                "journal_fenced": "" if fence is None else str(fence),
                "journal_full": fence is not None and fence.errno == errno.ENOSPC,
                "seq": self._commit.seq,
                "recovery": dataclasses.asdict(self.recovery_report),
                "restore_interrupted": self.restore_interrupted,
            }

    def chunks(self, tenant: str, *, limit: int, after: bytes = b"") -> list[dict[str, Any]]:
        """A page of the tenant's chunks in key order, those after key `after` (b"": from the
        start): key, tier, size, checksum, times, use counts."""
        with self._lock:
            ts = self._tenant(tenant)
            now = self._clock() - self._epoch
            return chunks_page(self._index, ts, now, limit=limit, after=after)

    def chunk(self, tenant: str, key: bytes) -> dict[str, Any]:
        """One chunk's record; UnknownKey when the tenant has no chunk under `key`."""
        check_key(key)
        with self._lock:
            ts = self._tenant(tenant)
            row = self._index.find(ts.tenant_id, key)
            if row == NO_ROW:
                raise UnknownKey(f"tenant {tenant!r} has no chunk {key.hex()}")
            return chunk_row(self._index, ts, row, self._clock() - self._epoch)

    def _update_gauges(self) -> None:
        for ts in self._tenants.values():
            for tier in ts.tiers:
                _USED.labels(ts.name, tier.spec.name).set(tier.alloc.used_blocks * BLOCK_SIZE)
                _RECORDS.labels(ts.name, tier.spec.name).set(tier.records)
                _INTEGRITY.labels(ts.name, tier.spec.name)  # a 0 sample before any failure

    # --- housekeeping and durability -------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Expire reservations and leases, group-commit the journal, checkpoint when due,
        demote and promote (the copies outside the lock)."""
        with self._lock:
            self._check_open()
            now = self._clock()
            reservations, leases = self._leases.expire(now)
            rewrite = self._commit.check_lost()
            if self._commit.fence is not None:
                self._commit.try_lift_fence()
                if self._commit.fence is None and self._commit.header_due:
                    recovery.segment_header(self._commit, self._tenants)
            synced = now - self._last_sync >= self.config.fsync_interval_s
            if synced:
                self._last_sync = now
            due = self._commit.journal.segment_bytes >= self.config.checkpoint_wal_bytes
            due = due and self._commit.fence is None
            order_due = now - self._order_saved >= self.config.policy_order_save_s
            if order_due:
                self._order_saved = now
            self._update_gauges()
        if rewrite:
            self._rewrite_journal()
        if synced:
            self._sync()  # outside the lock: lookups go on while the disk flushes
        demoted = self._mover.background_demote() if self._commit.fence is None else 0
        promoted = self._mover.background_promote() if self._commit.fence is None else 0
        if due:
            self.checkpoint()
        if order_due:
            self._save_policy_order()
        return {
            "reservations_expired": reservations,
            "leases_expired": leases,
            "demoted": demoted,
            "promoted": promoted,
            "synced": int(synced),
            "checkpointed": int(due),
        }

    def _sync(self) -> None:
        """Chunk data first, then the journal: a synced commit never points at unsynced data.
        Runs without the engine lock (fsync of a big dirty file takes a while); a failure
        fences writes: what the kernel failed to write may be gone."""
        with self._lock:
            devices = self._tenants.nvme_devices()
        err = self._commit.sync(devices)
        if err is not None:
            with self._lock:
                self._commit.set_fence(err)

    def persist_dram(self) -> dict[str, int]:
        """Move every DRAM chunk to NVMe where NVMe has free room (evicting nothing), one chunk
        at a time with the data copied outside the lock: what a backup runs first, since DRAM
        is volatile and a backup holds the persistent tier. `left`: chunks still only in DRAM
        (leased meanwhile, or no room)."""
        return self._mover.persist_dram()

    def checkpoint(self) -> dict[str, Any]:
        """Snapshot the persistent records, then drop the WAL segments the snapshot contains.
        JournalUnavailable (writes fenced) when the checkpoint cannot be written."""
        with self._checkpoint_lock:
            t0 = time.perf_counter()
            with self._lock:
                self._check_open()
                self._commit.check_writable()
                try:
                    columns, meta = recovery.snapshot(
                        self._index, self._commit, self._tenants, self._wall()
                    )
                except JournalError as e:  # the next segment could not be opened
                    self._commit.set_fence(e)
                    raise self._commit.unavailable(e) from e
                devices = self._tenants.nvme_devices()
            try:
                size = self._commit.write_checkpoint(devices, columns, meta)
            except JournalError as e:
                with self._lock:
                    self._commit.set_fence(e)
                raise self._commit.unavailable(e) from e
            self._write_policy_state()
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

    # --- eviction state across a restart ---------------------------------------------------

    def _save_policy_order(self) -> int:
        """Each tenant's NVMe eviction order to `policy-order.npz` (`_restart_order`): copied
        under the engine lock, one tenant at a time (the lock is held for one tier's copy at
        most), ordered and written outside it; the checkpoint lock keeps two saves from
        crossing (an older copy written over a newer one)."""
        with self._checkpoint_lock:
            with self._lock:
                self._check_open()
                tenants = self._tenants.values()
                parts = restart_order.shares({ts.name: restart_order.held(ts) for ts in tenants})
            orders = []
            for ts in tenants:
                with self._lock:
                    later = restart_order.take_order(ts, parts[ts.name])
                if later is not None:
                    orders.append((ts.name, later))
            return restart_order.save_order(orders, self._commit.journal.dir)

    def policy_state(self) -> dict[str, dict[str, dict[str, Any]]]:
        """tenant -> tier -> what its eviction policy begins from after a restart
        (`EvictionPolicy.state`); tiers whose policy keeps nothing are left out."""
        with self._lock:
            out: dict[str, dict[str, dict[str, Any]]] = {}
            for ts in self._tenants.values():
                tiers = {t.spec.name: t.policy.state() for t in ts.tiers}
                kept = {name: st for name, st in tiers.items() if st}
                if kept:
                    out[ts.name] = kept
            return out

    def restore_policies(self, state: Mapping[str, Any]) -> int:
        """Begin each tier's policy from `state` (`policy_state()` of an earlier run); entries
        naming no tenant or tier of this engine, or malformed, are skipped. Returns how many
        tiers were given theirs."""
        given = 0
        with self._lock:
            now = self._clock() - self._epoch  # the policies' time base (Records, Reads)
            for ts in self._tenants.values():
                tiers = state.get(ts.name)
                if not isinstance(tiers, Mapping):
                    continue
                for tier in ts.tiers:
                    st = tiers.get(tier.spec.name)
                    if isinstance(st, Mapping):
                        tier.policy.restore(st, now)
                        given += 1
        return given

    def _read_policy_state(self) -> dict[str, Any]:
        path = self._commit.journal.dir / POLICY_STATE
        try:
            raw = read_small_file(path, POLICY_STATE_BYTES_MAX)
            state = json.loads(raw) if len(raw) <= POLICY_STATE_BYTES_MAX else None
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:  # the policies start from their prior
            log.warning("engine.policy_state_unreadable", path=str(path), error=str(e))
            return {}
        if not isinstance(state, dict):
            log.warning("engine.policy_state_unreadable", path=str(path), error="not an object")
            return {}
        return state

    def _write_policy_state(self) -> None:
        """The file, where it changed since this engine last wrote it (a leader changes seldom;
        a checkpoint comes often, and each write is two fsyncs)."""
        data = json.dumps(self.policy_state(), sort_keys=True).encode()
        if data == self._policy_state_written:
            return
        try:
            jr.replace_file(self._commit.journal.dir / POLICY_STATE, data)
        except OSError as e:  # the next checkpoint tries again; a restart would use the prior
            log.warning("engine.policy_state_not_written", error=str(e))
            return
        self._policy_state_written = data

    def _rewrite_journal(self) -> None:
        """The live segment lost what was appended to it: checkpoint the index from memory
        (a new segment starts with it) with writes still fenced, then lift the fence. A
        failure keeps the fence; the next tick tries again."""
        with self._checkpoint_lock:
            with self._lock:
                self._check_open()
                fence, self._commit.fence = self._commit.fence, None  # the new segment's header
                try:
                    columns, meta = recovery.snapshot(
                        self._index, self._commit, self._tenants, self._wall()
                    )
                except JournalError as e:
                    self._commit.set_fence(e)
                    return
                finally:
                    self._commit.fence = self._commit.fence or fence
                devices = self._tenants.nvme_devices()
            try:
                self._commit.write_checkpoint(devices, columns, meta)
            except JournalError as e:
                with self._lock:
                    self._commit.set_fence(e)
                return
            with self._lock:
                self._commit.rewrite_due = False
                self._commit.lift_fence()
            log.warning("engine.journal_rewritten", records=len(columns["k0"]),
                        segment=meta["segment"])  # fmt: skip

    def close(self) -> None:
        """Demote DRAM chunks to NVMe where room allows, checkpoint, close devices."""
        with self._lock:
            if self._closed:
                return
            rewrite = self._commit.check_lost()
        if rewrite:
            self._rewrite_journal()
        with self._lock:
            if self._commit.fence is not None:
                self._commit.try_lift_fence()
            try:
                moved = self._mover.demote_all_dram()
            except (BlockDeviceError, JournalUnavailable) as e:  # DRAM chunks not moved are lost
                moved = 0
                log.warning("engine.close_demotion_failed", error=str(e))
        # what the policies learnt, for the next start to take over (_restart_order)
        ordered = self._save_policy_order()
        try:
            self.checkpoint()
        except EngineError as e:  # no checkpoint: the WAL keeps every commit, restart replays
            log.warning("engine.close_checkpoint_failed", error=str(e))
        with self._lock:
            try:
                self._commit.journal.close()
                jr.replace_file(self._commit.journal.dir / CLEAN_STOP, b"clean\n")
            except OSError as e:  # no marker: the next start reports an unclean stop, no harm
                log.warning("engine.clean_stop_marker_failed", error=str(e))
            except JournalError as e:  # the last fsync failed: a power loss may cost the tail
                log.error("engine.close_journal_sync_failed", error=str(e))
            for ts in self._tenants.values():
                for tier in ts.tiers:
                    tier.device.close()
            self._closed = True
        log.info("engine.closed", dram_chunks_kept=moved, policy_order_items=ordered)

    # --- backup ----------------------------------------------------------------------------

    def backup(self, dest_dir: str | Path, incremental: bool = False) -> dict[str, Any]:
        """Full or incremental backup of the persistent tier's chunks (ciphertext) and records;
        DRAM chunks are moved to NVMe first where there is room, and the result counts those
        that could not be (`dram_only_chunks`: not in the backup)."""
        persisted = self.persist_dram()
        result = backup_mod.backup(self, Path(dest_dir), incremental=incremental)
        moved, left = persisted["moved"], persisted["left"]
        return {**result, "dram_persisted": moved, "dram_only_chunks": left}

    def restore(self, backup_dirs: Sequence[str | Path], mode: str = "start") -> dict[str, Any]:
        """Load a full backup then its incrementals (oldest first) into this fresh engine;
        `mode` "resume" or "rollback" finishes an interrupted one (engine/backup.py)."""
        try:
            return backup_mod.restore(self, [Path(d) for d in backup_dirs], mode)
        finally:
            self.restore_interrupted = backup_mod.interrupted_restore(self.config.data_dir)
