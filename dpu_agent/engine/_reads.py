"""Reads: a lookup's longest cached prefix, the hits' access history and their leases.

The hot path of the control plane: a few hits are read and updated row by row through
memoryviews, many through numpy columns (same values either way). Called with the engine
lock held.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpu_agent.engine._leases import SCALAR_HITS_MAX, Leases
from dpu_agent.engine._records import Records
from dpu_agent.engine.types import ChunkLocation, TenantState
from dpu_agent.metrics import REGISTRY, Counter

__all__ = ["Reads", "joined_keys"]

ACCESS_COUNT_MASK = 0xFFFF_FFFF  # access_count is a uint32 column: it wraps (a hint, not a total)
_CHECKSUM = struct.Struct("<QQ")  # c0, c1 columns -> the 16 checksum bytes
_KEY_TYPES = frozenset({bytes, bytearray})
# tier, lba, block count, length, checksum of one of a lookup's hit rows
_HitColumns = tuple[int, int, int, int, bytes]

_LOOKUPS = Counter(
    "kvtier_engine_lookup_chunks",
    "Chunks asked for by lookups",
    ["tenant", "result"],
    registry=REGISTRY,
)


def check_key(key: bytes, what: str = "key") -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != 16:
        raise ValueError(f"chunk {what} must be 16 bytes, got {key!r:.60}")


def joined_keys(keys: Sequence[bytes]) -> bytes:
    """The keys, each checked as check_key does, packed into one buffer. The common case is
    checked by C loops; anything unusual takes the key-by-key path (which names a bad key)."""
    if not (set(map(type, keys)) <= _KEY_TYPES and set(map(len, keys)) <= {16}):
        for key in keys:
            check_key(key)
    return b"".join(keys)


class Reads:
    """Serves lookups. Owns the per-tenant lookup counters (label children bound once)."""

    def __init__(
        self, records: Records, leases: Leases, *, epoch: float, lease_ttl_s: float
    ) -> None:
        self._records, self._leases = records, leases
        self._epoch, self._lease_ttl_s = epoch, lease_ttl_s
        self._counters: dict[int, tuple[Any, Any]] = {}  # tenant id -> hit/miss counters

    def forget_tenant(self, tid: int) -> None:
        self._counters.pop(tid, None)

    def lookup(
        self, ts: TenantState, keys: Sequence[bytes], blob: bytes, now: float, *, lease: bool,
        as_lists: bool, count: bool = True,
    ) -> tuple[list[Any], int | None, float]:  # fmt: skip
        """(hits, lease id, lease seconds) of the longest cached prefix of `keys` (`blob`:
        the same keys joined); the hits leased when `lease`."""
        if not keys:
            return [], None, 0.0
        rows = self._records.index.find_prefix(ts.tenant_id, blob)
        if len(rows) > 1 and len(set(rows)) < len(rows):
            # A prefix never repeats a chunk (each key hashes every token before it): a
            # repeat ends it. Without this, one chunk asked for 4,096 times in a lookup
            # leased 4,096 hits of it (an attack pass: ~400 KB a lease, the other tenants'
            # lookups slowed to 240 ms, for the price of one 4 KiB chunk).
            seen: set[int] = set()
            for i, row in enumerate(rows):
                if row in seen:
                    rows = rows[:i]
                    break
                seen.add(row)
        n = len(rows)
        if count:
            self._count_lookup(ts, n, len(keys) - n)
        if n == 0:
            return [], None, 0.0
        if lease:
            self._leases.check_room(ts.tenant_id, rows, now)
        hits, extents = self._hit_locations(ts, rows, keys, now, lease=lease, as_lists=as_lists)
        if not lease:
            return hits, None, 0.0
        lease_id = self._leases.open(ts.tenant_id, extents, now + self._lease_ttl_s)
        return hits, lease_id, self._lease_ttl_s

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
        distinct row's lease column once, as Leases.unlease undoes)."""
        t = now - self._epoch
        hits: list[Any] = []
        extents = []
        tiers, extent_counts, tid = ts.tiers, self._leases.extent_counts, ts.tenant_id
        columns = self._read_hits(rows, t, lease=lease)
        # keys run on past the hit prefix: zip stops with the rows
        for row, key, cols in zip(rows, keys, columns, strict=False):
            t_index, lba, count, length, checksum = cols
            tier = tiers[t_index]
            item = self._records.item(tier, row)
            if item in tier.policy:
                tier.policy.access(item, t)
            else:  # recovered and not used since the restart: it joins the policy now
                self._records.policy_insert(tier, row, now)
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
                extent_counts[k] = extent_counts.get(k, 0) + 1
        return hits, extents

    def _read_hits(self, rows: list[int], t: float, *, lease: bool) -> list[_HitColumns]:
        """(tier, lba, block count, length, checksum) of each row; access counts and times
        (engine-clock `t`) moved on, lease counts raised when `lease` (each distinct row once).
        A few rows go through memoryviews, many through numpy columns: same values either way."""
        index = self._records.index
        if len(rows) > SCALAR_HITS_MAX:
            cols = index.cols
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
                    [sums[16 * i : 16 * i + 16] for i in range(len(rows))],
                    strict=True,
                )
            )
        v = index.col_views
        tier_v, lba_v, count_v, length_v = (v["tier"], v["lba"], v["block_count"],
                                            v["length"])  # fmt: skip
        c0_v, c1_v, pack = v["c0"], v["c1"], _CHECKSUM.pack
        access_v, prev_v, last_v, lease_v = (v["access_count"], v["prev_access"],
                                             v["last_access"], v["lease"])  # fmt: skip
        for row in set(rows):
            access_v[row] = (access_v[row] + 1) & ACCESS_COUNT_MASK  # wraps, as numpy's += does
            prev_v[row] = last_v[row]
            last_v[row] = t
            if lease:
                lease_v[row] += 1
        return [(tier_v[r], lba_v[r], count_v[r], length_v[r], pack(c0_v[r], c1_v[r]))
                for r in rows]  # fmt: skip
