"""The storage engine's core: records, tiers, leases, two-phase writes, eviction and durability.

One lock guards all mutable state. Chunk bytes move outside it: hosts read and write blocks
through the NVMe/TCP target with no engine call, `put_chunk`/`get_chunk` drop the lock for
their data I/O, and demotion copies in the background tick (a thread) outside the lock: a
reserve never copies a chunk (DRAM full: the chunk goes to NVMe). Only the close-time flush of
DRAM copies under the lock. The journal is written before the index changes, always.

Extent safety: an extent under lease is never freed, reused, evicted or demoted; a record deleted
while its extent is leased leaves the extent "deferred" until the last lease ends. Reserved
extents belong to their reservation until commit or expiry.
"""

from __future__ import annotations

import itertools
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import journal as jr
from dpu_agent.engine import recovery
from dpu_agent.engine._records import ITEM_ROW_BITS, RecordBookkeeping
from dpu_agent.engine.errors import (
    EngineError,
    JournalUnavailable,
    LeaseExpired,
    LimitExceeded,
    QuotaExceeded,
    ReservationExpired,
    TierFull,
    UnknownTenant,
)
from dpu_agent.engine.index import NO_ROW, RecordIndex
from dpu_agent.engine.journal import Journal
from dpu_agent.engine.tiers import DRAM, NVME, DeviceFactory, EmbeddedDevices, Tier, TierSpec
from dpu_agent.engine.types import (
    ChunkLocation,
    EngineConfig,
    Lease,
    LookupResult,
    PendingReservation,
    Reservation,
    TenantState,
)
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from kvproto.checksum import chunk_checksum
from kvproto.control import LOOKUP_KEYS_MAX, TENANTS_MAX, valid_tenant_name

__all__ = ["EngineCore"]

log = get_logger(__name__)

LEASES_MAX = 65536  # open leases; each costs ~200 B, and readers release within the TTL
RESERVATIONS_MAX = 65536  # open two-phase writes, same reasoning
EVICT_STEPS_MAX = 256  # evictions one placement may cause (mixed sizes can need several)
CHUNK_BYTES_MAX = 1 << 30  # one chunk; a 1 GiB KV chunk is far above any real layout
COUNT_MAX = 0xFFFF  # pin and lease counts are uint16 columns
ACCESS_COUNT_MASK = 0xFFFF_FFFF  # access_count is a uint32 column: it wraps (a hint, not a total)
SMALL_FRACTION = 8  # chunks above 1/8 of the DRAM tier go straight to NVMe
SCALAR_HITS_MAX = 16  # hits read and updated row by row; more go through numpy in bulk
_CHECKSUM = struct.Struct("<QQ")  # c0, c1 columns -> the 16 checksum bytes
_KEY_TYPES = frozenset({bytes, bytearray})
# tier, lba, block count, length, seq, checksum of one of a lookup's hit rows
_HitColumns = tuple[int, int, int, int, int, bytes]

_LOOKUPS = Counter(
    "kvtier_engine_lookup_chunks",
    "Chunks asked for by lookups",
    ["tenant", "result"],
    registry=REGISTRY,
)
_EVICTIONS = Counter(
    "kvtier_engine_evictions",
    "Chunks that left a tier",
    ["tenant", "tier", "action"],
    registry=REGISTRY,
)
_USED = Gauge(
    "kvtier_engine_tier_used_bytes",
    "Allocated bytes per tier",
    ["tenant", "tier"],
    registry=REGISTRY,
)
_RECORDS = Gauge(
    "kvtier_engine_records", "Committed chunks per tier", ["tenant", "tier"], registry=REGISTRY
)


def _check_key(key: bytes, what: str = "key") -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != 16:
        raise ValueError(f"chunk {what} must be 16 bytes, got {key!r:.60}")


def _joined_keys(keys: Sequence[bytes]) -> bytes:
    """The keys, each checked as _check_key does, packed into one buffer. The common case is
    checked by C loops; anything unusual takes the key-by-key path (which names a bad key)."""
    if not (set(map(type, keys)) <= _KEY_TYPES and set(map(len, keys)) <= {16}):
        for key in keys:
            _check_key(key)
    return b"".join(keys)


class EngineCore(RecordBookkeeping):
    """State, tenants, reads, two-phase writes, placement and eviction; `Engine` adds the rest."""

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
            device_factory = EmbeddedDevices(config.nvme_path, keystore)
        self._factory = device_factory
        self._index = RecordIndex()
        self._tenants: dict[str, TenantState] = {}
        self._by_id: dict[int, TenantState] = {}
        self._leases: OrderedDict[int, Lease] = OrderedDict()
        self._extent_leases: dict[tuple[int, int, int], int] = {}
        self._deferred: dict[tuple[int, int, int], tuple[int, bool]] = {}
        self._reservations: OrderedDict[int, PendingReservation] = OrderedDict()
        self._expired_leases: OrderedDict[int, float] = OrderedDict()
        self._expired_reservations: OrderedDict[int, float] = OrderedDict()
        # random start: ids from an earlier run are not mistaken for live ones
        self._ids = itertools.count(secrets.randbits(40) + 1)
        self._seq = 1
        self._counters: dict[int, tuple[Any, Any]] = {}  # tenant id -> lookup hit/miss counters
        self._last_sync = clock()
        self._closed = False
        self._fence: jr.JournalError | None = None  # set while the journal refuses writes
        self._journal = Journal(config.journal_path)
        try:
            self.recovery_report = recovery.recover(self)
            for name, quota in config.tenants.items():
                self.add_tenant(name, quota_bytes=quota)
        except BaseException:
            self._journal.close()  # a failed start must not keep the directory locked
            raise

    # --- tenants ---------------------------------------------------------------------------

    def add_tenant(self, tenant: str, *, quota_bytes: int = 0) -> None:
        """Create the tenant's tiers (idempotent; an existing tenant gets the new quota)."""
        if not valid_tenant_name(tenant):
            raise ValueError(
                f"tenant name {tenant!r} is invalid: use 1-63 lowercase letters, digits, '-'"
            )
        if quota_bytes < 0:
            raise ValueError(f"quota_bytes={quota_bytes}: give 0 (none) or a positive size")
        with self._lock:
            self._check_open()
            ts = self._tenants.get(tenant)
            if ts is not None:
                ts.quota_bytes = quota_bytes
                return
            if len(self._tenants) >= TENANTS_MAX:
                raise LimitExceeded(f"{TENANTS_MAX} tenants exist; remove one first")
            tid = min(set(range(1, len(self._by_id) + 2)) - set(self._by_id))
            self._wal(jr.pack_tenant(tid, self._next_seq(), tenant))
            self._build_tenant(tenant, tid, quota_bytes)
            log.info("engine.tenant_added", tenant=tenant, quota_bytes=quota_bytes)

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._tenants)

    def namespaces(self, tenant: str) -> dict[int, BlockDevice]:
        """What the NVMe/TCP target exports for the tenant: nsid -> (encrypting) device."""
        with self._lock:
            ts = self._tenant(tenant)
            return {t.spec.nsid: t.device for t in ts.tiers}

    def _build_tenant(
        self, name: str, tid: int, quota_bytes: int, nvme_generation: int | None = None
    ) -> TenantState:
        tiers = []
        sizes = {DRAM: self.config.dram_bytes, NVME: self.config.nvme_bytes}
        for index, size in sizes.items():
            spec = TierSpec(
                index=index,
                block_count=size // BLOCK_SIZE,
                persistent=index == NVME,
                key_generation=nvme_generation if index == NVME else None,
            )
            tiers.append(Tier.build(spec, self._factory(name, spec), self.config.eviction_policy))
        ts = TenantState(name=name, tenant_id=tid, tiers=tiers, quota_bytes=quota_bytes)
        self._tenants[name] = ts
        self._by_id[tid] = ts
        return ts

    def _tenant(self, name: str) -> TenantState:
        self._check_open()
        ts = self._tenants.get(name)
        if ts is None:
            raise UnknownTenant(
                f"tenant {name!r} is not configured on this agent; add it under "
                f"[tenants.{name}] in the config (or Engine.add_tenant)"
            )
        return ts

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed; start a new Engine on the same data_dir")

    # --- reads: lookup and leases ----------------------------------------------------------

    def lookup(self, tenant: str, keys: Sequence[bytes], *, lease: bool = True) -> LookupResult:
        """The longest cached prefix of `keys`, its extents leased until release() or TTL.
        `lease=False` is a probe: counters and access history move as for a read, but nothing
        is leased (lease_id None), so there is nothing to release and nothing to read under."""
        hits, lease_id, expires_s = self._lookup(tenant, keys, lease=lease, as_lists=False)
        return LookupResult(hits=hits, lease_id=lease_id, lease_expires_s=expires_s)

    def lookup_lists(
        self, tenant: str, keys: Sequence[bytes], *, lease: bool = True
    ) -> tuple[list[list[Any]], int | None, float]:
        """lookup() as (hits, lease_id, lease_expires_s), each hit a list [key, nsid, lba,
        block_count, length, checksum]: the control plane's reply shape, with no ChunkLocation
        built per hit on its hot path (about 1.5 us each)."""
        return self._lookup(tenant, keys, lease=lease, as_lists=True)

    def _lookup(
        self, tenant: str, keys: Sequence[bytes], *, lease: bool, as_lists: bool
    ) -> tuple[list[Any], int | None, float]:
        if len(keys) > LOOKUP_KEYS_MAX:
            raise LimitExceeded(f"lookup of {len(keys)} keys; split it into <= {LOOKUP_KEYS_MAX}")
        blob = _joined_keys(keys)
        with self._lock:
            ts = self._tenant(tenant)
            now = self._clock()
            if not keys:
                return [], None, 0.0
            rows = self._index.find_prefix(ts.tenant_id, blob)
            n = len(rows)
            self._count_lookup(ts, n, len(keys) - n)
            if n == 0:
                return [], None, 0.0
            if lease:
                self._check_lease_room(rows, now)
            hits, extents = self._hit_locations(ts, rows, keys, now, lease=lease, as_lists=as_lists)
            if not lease:
                return hits, None, 0.0
            held = Lease(lease_id=next(self._ids), tenant_id=ts.tenant_id, extents=extents,
                         expires=now + self.config.lease_ttl_s)  # fmt: skip
            self._leases[held.lease_id] = held
            return hits, held.lease_id, self.config.lease_ttl_s

    def release(self, tenant: str, lease_id: int) -> None:
        """End a lease. Raises LeaseExpired when it was already reclaimed after its TTL."""
        with self._lock:
            ts = self._tenant(tenant)
            lease = self._leases.get(lease_id)
            if lease is None or lease.tenant_id != ts.tenant_id:
                raise self._lease_gone(ts, lease_id, self._clock())
            del self._leases[lease_id]
            self._unlease(lease)

    def _count_lookup(self, ts: TenantState, hit_count: int, miss_count: int) -> None:
        ts.hits += hit_count
        ts.misses += miss_count
        counters = self._counters.get(ts.tenant_id)
        if counters is None:  # label children bound once per tenant: labels() costs microseconds
            counters = (_LOOKUPS.labels(ts.name, "hit"), _LOOKUPS.labels(ts.name, "miss"))
            self._counters[ts.tenant_id] = counters
        if hit_count:
            counters[0].inc(hit_count)
        if miss_count:
            counters[1].inc(miss_count)

    def _hit_locations(
        self,
        ts: TenantState,
        rows: list[int],
        keys: Sequence[bytes],
        now: float,
        *,
        lease: bool,
        as_lists: bool,
    ) -> tuple[list[Any], list[tuple[int, int, int, int]]]:
        """Locations of the hit rows (ChunkLocations, or lists in their field order), their
        access history updated, their extents leased when `lease` (each hit's extent; each
        distinct row's lease column once, as _unlease undoes)."""
        t = now - self._epoch
        hits: list[Any] = []
        extents = []
        tiers, extent_leases, tid = ts.tiers, self._extent_leases, ts.tenant_id
        columns = self._read_hits(rows, t, lease=lease)
        # keys run on past the hit prefix: zip stops with the rows
        for row, key, cols in zip(rows, keys, columns, strict=False):
            t_index, lba, count, length, seq, checksum = cols
            tier = tiers[t_index]
            item = (seq << ITEM_ROW_BITS) | row
            if item in tier.policy:
                tier.policy.access(item, t)
            else:  # recovered and not used since the restart: it joins the policy now
                self._policy_insert(tier, row, now)
            if as_lists:
                hits.append([bytes(key), t_index + 1, lba, count, length, checksum])
            else:
                hits.append(
                    ChunkLocation(key=bytes(key), nsid=t_index + 1, lba=lba, block_count=count,
                                  length=length, checksum=checksum)
                )  # fmt: skip
            if lease:
                extents.append((t_index, lba, count, row))
                k = (tid, t_index, lba)
                extent_leases[k] = extent_leases.get(k, 0) + 1
        return hits, extents

    def _read_hits(self, rows: list[int], t: float, *, lease: bool) -> list[_HitColumns]:
        """(tier, lba, block count, length, seq, checksum) of each row; access counts and times
        (engine-clock `t`) moved on, lease counts raised when `lease` (each distinct row once).
        A few rows go through memoryviews, many through numpy columns: same values either way."""
        if len(rows) > SCALAR_HITS_MAX:
            cols = self._index.cols
            hit = np.array(rows, dtype=np.int64)
            sums = np.stack((cols["c0"][hit], cols["c1"][hit]), axis=1).astype("<u8").tobytes()
            cols["access_count"][hit] += 1
            cols["prev_access"][hit] = cols["last_access"][hit]
            cols["last_access"][hit] = t
            if lease:
                cols["lease"][hit] += 1  # numpy adds once per distinct row
            return list(
                zip(
                    cols["tier"][hit].tolist(),
                    cols["lba"][hit].tolist(),
                    cols["block_count"][hit].tolist(),
                    cols["length"][hit].tolist(),
                    cols["seq"][hit].tolist(),
                    [sums[16 * i : 16 * i + 16] for i in range(len(rows))],
                    strict=True,
                )
            )
        v = self._index.col_views
        tier_v, lba_v, count_v, length_v, seq_v = (v["tier"], v["lba"], v["block_count"],
                                                   v["length"], v["seq"])  # fmt: skip
        c0_v, c1_v, pack = v["c0"], v["c1"], _CHECKSUM.pack
        access_v, prev_v, last_v, lease_v = (v["access_count"], v["prev_access"],
                                             v["last_access"], v["lease"])  # fmt: skip
        for row in set(rows):
            access_v[row] = (access_v[row] + 1) & ACCESS_COUNT_MASK  # wraps, as numpy's += does
            prev_v[row] = last_v[row]
            last_v[row] = t
            if lease:
                lease_v[row] += 1
        return [(tier_v[r], lba_v[r], count_v[r], length_v[r], seq_v[r], pack(c0_v[r], c1_v[r]))
                for r in rows]  # fmt: skip

    def _check_lease_room(self, rows: list[int], now: float) -> None:
        if len(self._leases) >= LEASES_MAX:
            self._expire(now)
            if len(self._leases) >= LEASES_MAX:
                raise LimitExceeded(f"{LEASES_MAX} leases are open; release() leases after reading")
        if len(rows) > SCALAR_HITS_MAX:
            most = int(self._index.cols["lease"][rows].max())
        else:
            lease_v = self._index.col_views["lease"]
            most = max(lease_v[r] for r in rows)
        if most >= COUNT_MAX:
            raise LimitExceeded(f"a chunk already has {COUNT_MAX} leases; release some first")

    def _lease_gone(self, ts: TenantState, lease_id: int, now: float) -> LeaseExpired:
        expired_at = self._expired_leases.get(lease_id)
        if expired_at is not None:
            return LeaseExpired(
                f"lease {lease_id:#x} expired {(now - expired_at) * 1e3:.0f} ms ago and its "
                "extents may have been reused; discard what was read under it and lookup() again"
            )
        return LeaseExpired(
            f"lease {lease_id:#x} is not held by tenant {ts.name!r} (never granted, already "
            "released, or expired long ago); lookup() again"
        )

    # --- writes: reserve and commit --------------------------------------------------------

    def reserve(
        self, tenant: str, key: bytes, length: int, parent: bytes | None = None
    ) -> Reservation:
        """Allocate blocks for a chunk of `length` bytes (evicting or demoting if needed)."""
        _check_key(key)
        if parent is not None:
            _check_key(parent, "parent key")
        if not 0 < length <= CHUNK_BYTES_MAX:
            raise ValueError(f"chunk length {length}: give 1..{CHUNK_BYTES_MAX} bytes")
        n = -(-length // BLOCK_SIZE)
        with self._lock:
            ts = self._tenant(tenant)
            self._check_writable()  # no point writing blocks a commit could not journal
            now = self._clock()
            if len(self._reservations) >= RESERVATIONS_MAX:
                self._expire(now)
                if len(self._reservations) >= RESERVATIONS_MAX:
                    raise LimitExceeded(
                        f"{RESERVATIONS_MAX} reservations are open; commit or let them expire"
                    )
            self._enforce_quota(ts, n, now)
            tier, lba = self._place(ts, n, length, now)
            res = PendingReservation(
                reservation_id=next(self._ids),
                tenant_id=ts.tenant_id,
                key=bytes(key),
                length=length,
                parent=None if parent is None else bytes(parent),
                tier=tier,
                lba=lba,
                block_count=n,
                expires=now + self.config.reservation_ttl_s,
            )
            self._reservations[res.reservation_id] = res
            ts.reserved_blocks += n
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
                    self._drop(ts, old)
                row = self._insert_record(ts, res, bytes(checksum), now)
            except JournalUnavailable:  # not journaled, so not committed: the blocks go back
                self._reclaim_reservation(res)
                raise
            ts.reserved_blocks -= res.block_count
            return self._location(row, res.key)

    def abort(self, tenant: str, reservation_id: int) -> None:
        """Give a reservation back without committing it."""
        with self._lock:
            ts = self._tenant(tenant)
            res = self._take_reservation(ts, reservation_id, self._clock())
            self._reclaim_reservation(res)

    def _take_reservation(self, ts: TenantState, rid: int, now: float) -> PendingReservation:
        res = self._reservations.get(rid)
        if res is None or res.tenant_id != ts.tenant_id:
            expired_at = self._expired_reservations.get(rid)
            if expired_at is not None:
                raise ReservationExpired(
                    f"reservation {rid:#x} expired {(now - expired_at) * 1e3:.0f} ms ago and its "
                    "extent was reclaimed; reserve() again and rewrite the chunk"
                )
            raise ReservationExpired(
                f"reservation {rid:#x} is not open for tenant {ts.name!r} (never made, already "
                "committed, or expired long ago); reserve() again and rewrite the chunk"
            )
        del self._reservations[rid]
        if now > res.expires:
            self._reclaim_reservation(res)
            self._remember(self._expired_reservations, rid, res.expires)
            raise ReservationExpired(
                f"reservation {rid:#x} expired {(now - res.expires) * 1e3:.0f} ms ago "
                f"(TTL {self.config.reservation_ttl_s} s); reserve() again and rewrite the chunk"
            )
        return res

    def _insert_record(
        self, ts: TenantState, res: PendingReservation, checksum: bytes, now: float
    ) -> int:
        """Journal (persistent tier), then index: a commit the journal refused is never served."""
        parent_row = NO_ROW
        if res.parent is not None:
            parent_row = self._index.find(ts.tenant_id, res.parent)
        tier = ts.tiers[res.tier]
        seq, created, generation = self._next_seq(), int(self._wall()), tier.devices.key_generation
        if tier.spec.persistent:
            self._wal(
                jr.pack_commit(ts.tenant_id, seq, res.key, checksum, res.tier, res.lba,
                               res.block_count, res.length, generation, created, res.parent)
            )  # fmt: skip
        row = self._index.insert(
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
        self._track(ts, res.tier, row, now)
        return row

    # --- placement and eviction ------------------------------------------------------------

    def _place(self, ts: TenantState, n: int, length: int, now: float) -> tuple[int, int]:
        """DRAM if it has room now, else NVMe (dropping NVMe victims), else DRAM dropping its
        victims: no chunk is copied here (demotion copies in the background tick, outside the
        lock and off the event loop)."""
        small = n <= ts.tiers[DRAM].alloc.block_count // SMALL_FRACTION
        steps = ((DRAM, False), (NVME, True), (DRAM, True)) if small else ((NVME, True),)
        for t, evict in steps:
            lba = self._make_room(ts, t, n, now, evict=evict)
            if lba is not None:
                return t, lba
        parts = []
        for tier in ts.tiers:
            parts.append(
                f"{tier.spec.name}: {tier.alloc.free_blocks} blocks free, largest extent "
                f"{tier.alloc.largest_free}"
            )
        cols = self._index.cols
        live = self._index.live_rows()
        mine = live[cols["tenant"][live] == ts.tenant_id]
        pinned = int(np.count_nonzero(cols["pin"][mine]))
        leased = int(np.count_nonzero(cols["lease"][mine]))
        raise TierFull(
            f"tenant {ts.name!r}: no room for a chunk of {length} bytes ({n} blocks) even after "
            f"eviction ({'; '.join(parts)}; {pinned} chunks pinned, {leased} leased, "
            f"{len(self._reservations)} reservations open); release leases, unpin or delete "
            "chunks, or give the tenant bigger tiers"
        )

    def _make_room(self, ts: TenantState, t: int, n: int, now: float, *, evict: bool) -> int | None:
        tier = ts.tiers[t]
        if n > tier.alloc.block_count:
            return None
        for _ in range(EVICT_STEPS_MAX):
            lba = tier.alloc.alloc(n)
            if lba is not None or not evict:
                return lba
            row = self._victim(tier, now)
            if row is None:
                return None
            self._evict(ts, t, row, now)
        return None

    def _evict(self, ts: TenantState, t: int, row: int, now: float) -> None:
        assert self._evictable(row), row
        self._drop(ts, row)
        ts.evictions += 1
        _EVICTIONS.labels(ts.name, ts.tiers[t].spec.name, "drop").inc()

    def _demote(self, ts: TenantState, row: int, now: float, *, evict: bool) -> bool:
        """Move a DRAM chunk to NVMe (verifying it); False when NVMe has no room for it. The
        NVMe extent goes back if the write or the journal fails (then the error is raised)."""
        cols = self._index.cols
        n, src = int(cols["block_count"][row]), int(cols["lba"][row])
        length = int(cols["length"][row])
        dst = self._make_room(ts, NVME, n, now, evict=evict)
        if dst is None:
            return False
        buf = bytearray(n * BLOCK_SIZE)
        key = self._index.key_of(row)
        generation = ts.tiers[NVME].devices.key_generation
        try:
            ts.tiers[DRAM].device.read_into(src, memoryview(buf))
            if chunk_checksum(key, memoryview(buf)[:length]) != self._checksum(row):
                ts.tiers[NVME].alloc.free(dst, n)
                self._integrity_failure(ts, row)
                return True
            ts.tiers[NVME].device.write(dst, memoryview(buf))
            seq = self._journal_move(ts, row, NVME, dst, generation)
        except BaseException:
            ts.tiers[NVME].alloc.free(dst, n)
            raise
        self._untrack(ts, DRAM, row)
        ts.tiers[DRAM].alloc.free(src, n)
        cols["tier"][row] = NVME
        cols["lba"][row] = dst
        cols["generation"][row] = generation
        cols["seq"][row] = seq
        self._track(ts, NVME, row, now)
        ts.demotions += 1
        _EVICTIONS.labels(ts.name, "dram", "demote").inc()
        return True

    def _enforce_quota(self, ts: TenantState, n: int, now: float) -> None:
        quota = ts.quota_bytes
        if not quota:
            return
        if n * BLOCK_SIZE > quota:
            raise QuotaExceeded(
                f"a chunk of {n * BLOCK_SIZE} bytes exceeds tenant {ts.name!r}'s quota of "
                f"{quota} bytes; raise the quota"
            )
        for _ in range(EVICT_STEPS_MAX):
            if (ts.used_blocks + n) * BLOCK_SIZE <= quota or not self._drop_one(ts):
                break
        if (ts.used_blocks + n) * BLOCK_SIZE > quota:
            raise QuotaExceeded(
                f"tenant {ts.name!r} uses {ts.used_blocks * BLOCK_SIZE} of its {quota}-byte "
                f"quota and cannot evict enough for {n * BLOCK_SIZE} more bytes (chunks pinned, "
                "leased or reserved); release leases, unpin or delete chunks, or raise the quota"
            )

    def _drop_one(self, ts: TenantState) -> bool:
        """Drop the coldest evictable chunk of the tenant (NVMe first); False if there is none."""
        for t in (NVME, DRAM):
            row = self._victim(ts.tiers[t], self._clock())
            if row is not None:
                self._drop(ts, row)
                ts.evictions += 1
                _EVICTIONS.labels(ts.name, ts.tiers[t].spec.name, "drop").inc()
                return True
        return False
