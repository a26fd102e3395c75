"""Rebuilding the engine at start (checkpoint + WAL) and taking checkpoint snapshots.

Restart is numpy work only (loading columns, rebuilding the slot table and the allocators,
ordering the records for eviction). The eviction policies start empty: a recovered record
joins its tier's policy when it is first used, and records never used since the restart are
evicted first (see Tier.cold); after a clean stop the engine then hands the hottest of them
back to the policy in the order it had (`_restart_order`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agent.engine._records import ITEM_ROW_BITS
from dpu_agent.engine.alloc import AllocError, ExtentAllocator
from dpu_agent.engine.index import COLUMNS, NO_ROW, TENANT_MIX, RecordIndex
from dpu_agent.engine.journal import (
    CHECKPOINT_COLUMNS,
    COMMIT_DTYPE,
    DELETE_DTYPE,
    OP_QUARANTINE,
    JournalError,
    Recovered,
    pack_extent,
    pack_tenant,
)
from dpu_agent.engine.tiers import NVME
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Gauge
from kvproto.control import valid_tenant_name

BITMAP_BITS = 22  # 512 KiB prefilter for "does the WAL touch this checkpoint key"

if TYPE_CHECKING:
    from dpu_agent.engine._commit import CommitLog
    from dpu_agent.engine._tenants import Tenants

__all__ = ["RecoveryReport", "recover", "segment_header", "snapshot"]

log = get_logger(__name__)

_DROPPED = Gauge(
    "kvtier_engine_recovery_dropped",
    "What the last start could not use: damaged WAL frames, missing WAL segments, damaged "
    "checkpoints, records",
    ["kind"],
    registry=REGISTRY,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryReport:
    records: int
    checkpoint_records: int
    wal_records: int
    torn_segments: int
    damaged_frames: int  # WAL frames that failed their check (skipped; the rest replayed)
    missing_segments: int  # WAL segments the replay needed that were gone (what they held lost)
    checkpoint_used: str  # "current", "previous" or "none" (index rebuilt from the WAL)
    checkpoints_damaged: int  # checkpoint files that failed their checksum (kept as *.damaged)
    dropped_records: int  # records that could not be placed (unknown tenant, overlap, range)
    load_s: float  # reading the checkpoint and the WAL
    index_s: float  # rebuilding the index and allocators
    policy_s: float  # ordering the recovered records for eviction (cold lists)
    total_s: float
    # how the previous run ended: "clean" (close() finished: marker CLEAN_STOP found),
    # "unclean" (killed, crashed, power lost: the journal was replayed), "first" (no journal)
    previous_stop: str = "first"


def recover(
    commit: CommitLog,
    tenants: Tenants,
    index: RecordIndex,
    quotas: dict[str, int],
    *,
    clean_stop: bool = False,
) -> RecoveryReport:
    """Fill a new engine's parts from its journal directory and open a fresh WAL segment
    (`quotas`: the configured tenants' quotas, tenant name -> bytes; `clean_stop`: the
    previous run's close finished, its CLEAN_STOP marker found)."""
    t0 = time.perf_counter()
    rec = commit.journal.load()
    t1 = time.perf_counter()
    fields = _merge(rec)
    _name_orphans(rec, fields)
    dropped = [0]
    for tid, name in sorted(rec.tenants.items()):
        gens = np.unique(fields["generation"][fields["tenant"] == tid])
        if len(gens) > 1:
            raise JournalError(
                f"tenant {name!r} has NVMe chunks under key generations {gens.tolist()}; one "
                "device has one key: restore from a backup"
            )
        gen = int(gens[0]) if len(gens) else None
        if gen is not None and name in quotas:  # one not configured is erased after start
            tenants.require_key(name, gen)
        tenants.build(name, tid, quotas.get(name, 0), gen)
    fields = _drop_out_of_range(tenants, fields, dropped)
    fields = _drop_overlaps(fields, dropped)
    parents = (
        fields.pop("pk0"),
        fields.pop("pk1"),
        fields.pop("hp").astype(bool),
        fields.pop("pidx"),
    )
    rows = index.insert_many(fields)
    _link_parents(index, rows, parents)
    _rebuild_allocators(tenants, index, rows, rec)
    t2 = time.perf_counter()
    _cold_lists(tenants, index, rows)
    t3 = time.perf_counter()
    commit.seq = rec.next_seq
    try:
        commit.journal.open_segment(commit.journal.segment)
    except JournalError as e:  # a full disk: start anyway, writes fenced; a probe reopens it
        commit.set_fence(e)
    segment_header(commit, tenants)
    empty = len(rows) == 0 and rec.wal_records == 0
    previous = "clean" if clean_stop else "first" if empty else "unclean"
    report = RecoveryReport(
        records=len(rows),
        checkpoint_records=rec.checkpoint_records,
        wal_records=rec.wal_records,
        torn_segments=rec.torn_segments,
        damaged_frames=rec.damaged_frames,
        missing_segments=rec.missing_segments,
        checkpoint_used=rec.checkpoint_used,
        checkpoints_damaged=rec.checkpoints_damaged,
        dropped_records=dropped[0],
        load_s=t1 - t0,
        index_s=t2 - t1,
        policy_s=t3 - t2,
        total_s=time.perf_counter() - t0,
        previous_stop=previous,
    )
    if report.records or report.wal_records:
        log.info("engine.recovered", **{k: getattr(report, k) for k in report.__slots__})
    _DROPPED.labels("wal_frames").set(report.damaged_frames)
    _DROPPED.labels("checkpoints").set(report.checkpoints_damaged)
    _DROPPED.labels("records").set(report.dropped_records)
    _DROPPED.labels("wal_segments").set(report.missing_segments)
    if (report.damaged_frames or report.missing_segments or report.checkpoints_damaged
            or report.dropped_records):  # fmt: skip
        log.error(
            "engine.recovered_with_losses",
            damaged_frames=report.damaged_frames,
            missing_segments=report.missing_segments,
            checkpoints_damaged=report.checkpoints_damaged,
            checkpoint_used=report.checkpoint_used,
            dropped_records=report.dropped_records,
        )
    return report


def segment_header(commit: CommitLog, tenants: Tenants) -> None:
    """Tenant and NVMe quarantine records at the start of each segment, so the WAL alone
    names every tenant when no checkpoint verifies. A failing append fences the engine; the
    header is then written when the fence lifts (`header_due`)."""
    commit.header_due = True
    for ts in tenants.by_ids():
        commit.append_soft(pack_tenant(ts.tenant_id, commit.next_seq(), ts.name))
        for lba, n in sorted(ts.tiers[NVME].quarantined.items()):
            seq = commit.next_seq()
            commit.append_soft(pack_extent(OP_QUARANTINE, ts.tenant_id, seq, NVME, lba, n))
    commit.header_due = commit.fence is not None


def _cold_lists(tenants: Tenants, index: RecordIndex, rows: np.ndarray) -> None:
    """Per tenant: record counts, and the recovered rows in eviction order (leaves first, then
    parents; oldest first within each) for the policy to take over as they are used."""
    cols = index.cols
    is_parent = np.zeros(len(cols["parent"]), dtype=bool)
    parents = cols["parent"][rows]
    is_parent[parents[parents >= 0]] = True
    for ts in tenants.by_ids():
        tier = ts.tiers[NVME]
        mine = rows[cols["tenant"][rows] == ts.tenant_id]
        tier.records = len(mine)
        tier.used_blocks_records = int(cols["block_count"][mine].sum())
        rank = cols["seq"][mine] | (is_parent[mine].astype(np.uint64) << np.uint64(63))
        order = mine[np.argsort(rank, kind="stable")]  # leaves first, oldest first
        seq = cols["seq"][order].astype(np.uint64)
        tier.cold = (seq << np.uint64(ITEM_ROW_BITS)) | order.astype(np.uint64)
        tier.cold_pos = 0


def _empty_fields() -> dict[str, np.ndarray]:
    fields = {name: np.zeros(0, COLUMNS[name]) for name in CHECKPOINT_COLUMNS}
    fields.update(pk0=np.zeros(0, "<u8"), pk1=np.zeros(0, "<u8"), hp=np.zeros(0, "u1"))
    fields["pidx"] = np.zeros(0, np.int64)
    return fields


def _fingerprint(tenant: np.ndarray, k0: np.ndarray) -> np.ndarray:
    return k0.astype(np.uint64) ^ (tenant.astype(np.uint64) * np.uint64(TENANT_MIX))


def _merge(rec: Recovered) -> dict[str, np.ndarray]:
    """Checkpoint rows whose key the WAL never touched, plus the WAL's winning commits (the
    last op per key wins; a delete wins by removing the key)."""
    base = dict(rec.columns) if rec.columns else _empty_fields()
    if "pidx" not in base:
        base["pidx"] = np.full(len(base["k0"]), -1, np.int64)
    commits = np.concatenate(rec.wal_commits) if rec.wal_commits else np.zeros(0, COMMIT_DTYPE)
    deletes = np.concatenate(rec.wal_deletes) if rec.wal_deletes else np.zeros(0, DELETE_DTYPE)
    for tid, removed_seq in rec.removed_tenants.items():  # crypto-erased: older records go
        base = _filter_rows(base, ~((base["tenant"] == tid) & (base["seq"] < removed_seq)))
        commits = commits[~((commits["tenant"] == tid) & (commits["seq"] < removed_seq))]
        deletes = deletes[~((deletes["tenant"] == tid) & (deletes["seq"] < removed_seq))]
    if len(commits) + len(deletes) == 0:
        return base
    cols = {n: np.concatenate((commits[n], deletes[n])) for n in ("tenant", "k0", "k1", "seq")}
    order = np.lexsort((cols["seq"], cols["k1"], cols["k0"], cols["tenant"]))
    t, k0, k1 = cols["tenant"][order], cols["k0"][order], cols["k1"][order]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (t[1:] != t[:-1]) | (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
    winners = order[last]
    final = commits[winners[winners < len(commits)]]
    keep = _untouched(base, cols["tenant"][winners], cols["k0"][winners], cols["k1"][winners])
    fields = _filter_rows(base, keep)
    wal = {name: final[name] for name in fields if name != "pidx"}
    wal["pidx"] = np.full(len(final), -1, np.int64)
    return {
        name: np.concatenate((fields[name], wal[name].astype(fields[name].dtype)))
        for name in fields
    }


def _filter_rows(fields: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The rows where keep is True; parent positions are renumbered (-1 if the parent went)."""
    if keep.all():
        return fields
    out = {name: col[keep] for name, col in fields.items()}
    newpos = np.cumsum(keep) - 1
    pidx = out["pidx"]
    valid = pidx >= 0
    valid[valid] = keep[pidx[valid]]
    out["pidx"] = np.where(valid, newpos[np.where(valid, pidx, 0)], -1)
    return out


def _untouched(
    base: dict[str, np.ndarray], t: np.ndarray, k0: np.ndarray, k1: np.ndarray
) -> np.ndarray:
    """Mask of checkpoint rows whose (tenant, key) is not among (t, k0, k1)."""
    touched = np.sort(_fingerprint(t, k0))
    fp = _fingerprint(base["tenant"], base["k0"])
    bitmap = np.zeros(1 << BITMAP_BITS, dtype=bool)  # a cache-sized prefilter: few candidates
    bitmap[touched & np.uint64((1 << BITMAP_BITS) - 1)] = True
    cand = np.flatnonzero(bitmap[fp & np.uint64((1 << BITMAP_BITS) - 1)])
    at = np.minimum(np.searchsorted(touched, fp[cand]), len(touched) - 1)
    cand = cand[touched[at] == fp[cand]]
    keep = np.ones(len(base["k0"]), dtype=bool)
    if len(cand):
        tmp = RecordIndex(len(t))
        tmp.insert_many({"k0": k0, "k1": k1, "tenant": t})
        hit = tmp.find_many(base["tenant"][cand], base["k0"][cand], base["k1"][cand]) != NO_ROW
        keep[cand[hit]] = False
    return keep


def _name_orphans(rec: Recovered, fields: dict[str, np.ndarray]) -> None:
    """Records of a tenant id that no surviving WAL frame or checkpoint names (its tenant
    frame was damaged or lost with a truncated segment) take the name tenant-ids.json gives
    that id, unless another id already has that name."""
    taken = set(rec.tenants.values())
    for tid in np.unique(fields["tenant"]).tolist():
        name = rec.tenant_ids.get(tid)
        if tid in rec.tenants or name is None or name in taken or not valid_tenant_name(name):
            continue
        rec.tenants[tid] = name
        taken.add(name)
        log.warning("engine.tenant_named_by_id_file", tenant=name, tenant_id=tid,
                    records=int((fields["tenant"] == tid).sum()))  # fmt: skip


def _drop_out_of_range(
    tenants: Tenants, fields: dict[str, np.ndarray], dropped: list[int]
) -> dict[str, np.ndarray]:
    """Records outside their tenant's device (it shrank), or of a tenant id that nothing left
    names (no WAL frame, checkpoint or tenant-ids.json entry), are dropped and counted."""
    keep = np.ones(len(fields["k0"]), dtype=bool)
    for tid in np.unique(fields["tenant"]).tolist():
        mine = fields["tenant"] == tid
        ts = tenants.find_id(tid)
        if ts is None:
            log.error("engine.recovery_dropped", tenant_id=tid, records=int(mine.sum()),
                      reason="no tenant record survived")  # fmt: skip
            keep &= ~mine
            continue
        limit = ts.tiers[NVME].alloc.block_count
        end = fields["lba"].astype(np.int64) + fields["block_count"]
        bad = mine & ((end > limit) | (fields["tier"] != NVME))
        if bad.any():
            log.warning("engine.recovery_dropped", tenant=ts.name, records=int(bad.sum()))
            keep &= ~bad
    dropped[0] += int((~keep).sum())
    return _filter_rows(fields, keep)


def _drop_overlaps(fields: dict[str, np.ndarray], dropped: list[int]) -> dict[str, np.ndarray]:
    """Records whose extents overlap within a tenant (a skipped frame was the delete before a
    reuse): the newest keeps the extent, the older ones are dropped and counted. Tenants have
    devices of their own, so their extents share block numbers freely. Vectorised but for the
    records in a cluster of overlapping extents (damage), each cluster settled on its own."""
    if not len(fields["lba"]):
        return fields
    tenant, lba = fields["tenant"].astype(np.int64), fields["lba"].astype(np.int64)
    end = lba + fields["block_count"]
    order = np.lexsort((lba, tenant))
    t_s, l_s, e_s = tenant[order], lba[order], end[order]
    first = np.ones(len(order), dtype=bool)  # a tenant's first extent, by block number
    first[1:] = t_s[1:] != t_s[:-1]
    reach = np.empty_like(e_s)  # the furthest end so far, within the tenant
    starts = np.flatnonzero(first).tolist()
    for a, b in zip(starts, [*starts[1:], len(order)], strict=True):
        reach[a:b] = np.maximum.accumulate(e_s[a:b])
    joins = ~first[1:] & (l_s[1:] < reach[:-1])  # starts before an earlier extent has ended
    if not joins.any():
        return fields
    cluster = np.cumsum(np.concatenate(([True], ~joins))) - 1
    suspect = np.bincount(cluster)[cluster] > 1
    rows, clusters = order[suspect], cluster[suspect]
    newest_first = np.lexsort((-fields["seq"].astype(np.int64)[rows], clusters))
    keep = np.ones(len(lba), dtype=bool)
    taken: dict[int, list[tuple[int, int]]] = {}
    for k in newest_first.tolist():  # only the overlapping clusters: small, after damage
        i = int(rows[k])
        spans = taken.setdefault(int(clusters[k]), [])
        if any(s < end[i] and lba[i] < e for s, e in spans):
            keep[i] = False
        else:
            spans.append((int(lba[i]), int(end[i])))
    log.error("engine.recovery_dropped", records=int((~keep).sum()), reason="overlapping extents")
    dropped[0] += int((~keep).sum())
    return _filter_rows(fields, keep)


def _link_parents(index: RecordIndex, rows: np.ndarray, parents: tuple[np.ndarray, ...]) -> None:
    """Checkpoint rows name their parent by position (no lookup); the rest by key."""
    pk0, pk1, has, pidx = parents
    by_pos = pidx >= 0
    index.cols["parent"][rows[by_pos]] = rows[pidx[by_pos]].astype(np.int32)
    by_key = has & ~by_pos
    if by_key.any():
        found = index.find_many(index.cols["tenant"][rows[by_key]], pk0[by_key], pk1[by_key])
        index.cols["parent"][rows[by_key]] = found.astype(np.int32)


def _rebuild_allocators(
    tenants: Tenants, index: RecordIndex, rows: np.ndarray, rec: Recovered
) -> None:
    cols = index.cols
    for ts in tenants.by_ids():
        tier = ts.tiers[NVME]
        mine = rows[cols["tenant"][rows] == ts.tenant_id]
        quarantined = [
            (lba, n) for tid, t, lba, n in rec.quarantined if tid == ts.tenant_id and t == NVME
        ]
        q = np.array(quarantined, dtype=np.int64).reshape(-1, 2)
        lbas = np.concatenate((cols["lba"][mine].astype(np.int64), q[:, 0]))
        counts = np.concatenate((cols["block_count"][mine].astype(np.int64), q[:, 1]))
        try:
            tier.alloc = ExtentAllocator.from_used(tier.alloc.block_count, lbas, counts)
        except AllocError:  # a quarantine overlaps a record or the tier: forget the quarantine
            log.error("engine.recovery_quarantine_dropped", tenant=ts.name, extents=len(q))
            quarantined = []
            tier.alloc = ExtentAllocator.from_used(
                tier.alloc.block_count, cols["lba"][mine].astype(np.int64),
                cols["block_count"][mine].astype(np.int64),
            )  # fmt: skip
        tier.quarantined = dict(quarantined)


def snapshot(
    index: RecordIndex, commit: CommitLog, tenants: Tenants, wall_now: float
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Columns of the persistent records and the checkpoint's metadata; rotates the WAL, so
    every record appended after this call lands in a segment the checkpoint does not cover.
    `wall_now`: the unix time the checkpoint records as its creation."""
    cols = index.cols
    live = index.live_rows()
    sel = live[cols["tier"][live] == NVME]
    columns = {name: cols[name][sel].copy() for name in CHECKPOINT_COLUMNS}
    parent = cols["parent"][sel].astype(np.int64)
    safe = np.where(parent >= 0, parent, 0)
    has = (parent >= 0) & (cols["state"][safe] == 1) & (cols["tenant"][safe] == cols["tenant"][sel])
    columns["pk0"] = np.where(has, cols["k0"][safe], 0).astype("<u8")
    columns["pk1"] = np.where(has, cols["k1"][safe], 0).astype("<u8")
    columns["hp"] = has.astype("u1")
    position = np.full(len(cols["parent"]), -1, np.int64)
    position[sel] = np.arange(len(sel))
    columns["pidx"] = np.where(has, position[safe], -1)  # parent's position in this checkpoint
    commit.journal.open_segment(commit.journal.segment + 1)
    segment_header(commit, tenants)
    quarantined = [
        [ts.tenant_id, NVME, lba, n]
        for ts in tenants.by_ids()
        for lba, n in ts.tiers[NVME].quarantined.items()
    ]
    meta = {
        "tenants": {str(tid): name for tid, name in tenants.names_by_id().items()},
        "quarantined": quarantined,
        "next_seq": commit.seq,
        "segment": commit.journal.segment,
        "created_unix": wall_now,
    }
    return columns, meta
