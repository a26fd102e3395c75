"""Read-only views of the engine's state for operators: per-tenant stats and the chunk
listing of `dpuctl chunks`. Pure functions of the parts' state; called with the engine lock
held."""

from __future__ import annotations

from typing import Any

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE
from dpu_agent.engine._leases import Leases
from dpu_agent.engine.index import RecordIndex
from dpu_agent.engine.types import TenantState

__all__ = ["CHUNKS_PAGE_MAX", "STAT_TOTALS", "chunk_row", "chunks_page", "tenant_stats"]

CHUNKS_PAGE_MAX = 1000  # rows of `dpuctl chunks ls` per request: ~150 KB, well under a frame
STAT_TOTALS = ("records", "hits", "misses", "evictions", "demotions", "promotions",
               "integrity_failures", "tiers_full")  # fmt: skip


def tenant_stats(ts: TenantState, leases: Leases) -> dict[str, Any]:
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
            # the file system under a file-backed tier refused its last write for space
            "full": bool(getattr(tier.devices.raw, "full", False)),
            "full_writes": int(getattr(tier.devices.raw, "full_writes", 0)),
        }
    open_leases, open_reservations = leases.count(ts.tenant_id)
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
        "tiers_full": sum(t["full"] for t in tiers.values()),
        "leases": open_leases,
        "reservations": open_reservations,
        "tiers": tiers,
    }


def chunks_page(
    index: RecordIndex, ts: TenantState, engine_now: float, *, limit: int, after: bytes
) -> list[dict[str, Any]]:
    """A page of the tenant's chunks in key order, those after key `after` (b"": from the
    start). `engine_now`: the engine clock less its epoch (what access times count from)."""
    assert 0 < limit <= CHUNKS_PAGE_MAX, limit
    cols = index.cols
    live = index.live_rows()
    rows = live[cols["tenant"][live] == ts.tenant_id]
    # key order = the bytes' order: compare the little-endian words byte-swapped
    hi, lo = cols["k0"][rows].byteswap(), cols["k1"][rows].byteswap()
    rows = rows[np.lexsort((lo, hi))]
    if after:
        a_hi = int.from_bytes(after[:8], "big")
        a_lo = int.from_bytes(after[8:16], "big")
        hi, lo = cols["k0"][rows].byteswap(), cols["k1"][rows].byteswap()
        rows = rows[(hi > a_hi) | ((hi == a_hi) & (lo > a_lo))]
    return [chunk_row(index, ts, int(r), engine_now) for r in rows[:limit]]


def chunk_row(index: RecordIndex, ts: TenantState, row: int, engine_now: float) -> dict[str, Any]:
    """One chunk's record: key, tier, size, checksum, times, use counts."""
    c = index.cols
    tier = ts.tiers[int(c["tier"][row])]
    checksum = int(c["c0"][row]).to_bytes(8, "little") + int(c["c1"][row]).to_bytes(8, "little")
    idle_s = max(0.0, engine_now - float(c["last_access"][row]))
    return {
        "key": index.key_of(row).hex(),
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
