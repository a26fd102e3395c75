"""What a view change means for the keys one node holds, at a cost proportional to the keys
whose owners changed.

`OwnerTable` remembers, for every key the node held at the last settled pass, its owners
under that view (indexes into the view's serving names). On a new view, `plan` reuses every
row it can: with equal weights and no zones (Placement.delta_safe) a key's owners change only
when a joined node outranks the key's R-th owner or a gone node was one of them, which one
vectorised hash per key and joined node and one comparison per gone node decide; only those
keys get a full rendezvous ranking under the new view (O(N) each), and keys the table has not
seen yet one under the settled view. Weighted or zoned views rank every key again (documented
in docs/CLUSTER.md). Keys are processed in sorted order (the table is sorted), so matching
them against the table streams through memory instead of jumping around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvproto.placement import Placement

__all__ = ["OwnerTable", "Plan", "plan"]


@dataclass(slots=True)
class OwnerTable:
    """Owners of held keys under one view: `owners[i]` indexes `names` (-1: fewer owners)."""

    epoch: int
    names: tuple[str, ...]
    k64: np.ndarray  # sorted
    owners: np.ndarray  # [len(k64) x r] int32


@dataclass(slots=True)
class Plan:
    """For the keys given to `plan` (in their order): owners now, owners under the settled
    view (None for a node with no settled view), and which keys' owner sets changed."""

    names: tuple[str, ...]  # the new view's serving names (what `after` indexes)
    before_names: tuple[str, ...]
    after: np.ndarray  # [n x r]
    before: np.ndarray | None  # [n x r]
    changed: np.ndarray  # bool [n]
    ranked: int  # keys ranked in full (the O(N)-per-key part)
    table: OwnerTable  # `after` as the table to keep once this view settles


def _full(p: Placement, k64: np.ndarray, r: int) -> np.ndarray:
    out = np.full((len(k64), r), -1, dtype=np.int32)
    if len(k64) and len(p.serving):
        idx = p.owner_index(k64, r)
        out[:, : idx.shape[1]] = idx
    return out


def _reindex(rows: np.ndarray, src: tuple[str, ...], dst: tuple[str, ...]) -> np.ndarray:
    """Owner rows indexing `src` rewritten to index `dst` (-1 where a name is not in dst)."""
    pos = {n: i for i, n in enumerate(dst)}
    m = np.array([pos.get(n, -1) for n in src] + [-1], dtype=np.int32)
    return m[rows]  # -1 indexes the trailing -1


def plan(
    k64: np.ndarray,
    r: int,
    new: Placement,
    settled: Placement | None,
    table: OwnerTable | None,
) -> Plan:
    names = tuple(n.name for n in new.serving)
    k64 = np.asarray(k64, dtype=np.uint64)
    n = len(k64)
    order = np.argsort(k64, kind="stable")
    ks = k64[order]
    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.arange(n)
    if settled is None:
        after_s = _full(new, ks, r)
        return Plan(names, (), after_s[inv], None, np.ones(n, dtype=bool), n,
                    OwnerTable(new.epoch, names, ks, after_s))  # fmt: skip
    old_names = tuple(x.name for x in settled.serving)
    before = np.full((n, r), -1, dtype=np.int32)
    known = np.zeros(n, dtype=bool)
    if table is not None and table.epoch == settled.epoch and len(table.k64):
        pos = np.minimum(np.searchsorted(table.k64, ks), len(table.k64) - 1)
        known = table.k64[pos] == ks
        before[known] = _reindex(table.owners[pos[known]], table.names, old_names)
    unknown = ~known
    ranked = int(unknown.sum())
    if ranked:
        before[unknown] = _full(settled, ks[unknown], r)
    common = {x.name: (x.capacity_bytes, x.zone) for x in new.serving}
    delta = (
        settled.delta_safe
        and new.delta_safe
        and all(
            common[x.name] == (x.capacity_bytes, x.zone)
            for x in settled.serving
            if x.name in common
        )
    )
    if delta:
        joined = [x for x in names if x not in old_names]
        gone = [i for i, x in enumerate(old_names) if x not in names]
        flag = np.zeros(n, dtype=bool)
        if joined and len(old_names) < r:  # fewer nodes than R: any join adds an owner
            flag[:] = True
        elif joined:
            rth = Placement.hash_pairs(ks, old_names, np.maximum(before[:, -1], 0))
            for j in joined:
                flag |= new.hash_column(ks, j) > rth
        for g in gone:
            flag |= (before == g).any(axis=1)
        after = _reindex(before, old_names, names)
    else:
        flag = np.ones(n, dtype=bool)
        after = np.empty_like(before)
    nflag = int(flag.sum())
    if nflag:
        after[flag] = _full(new, ks[flag], r)
    ranked += nflag
    b = np.sort(_reindex(before, old_names, names), axis=1)
    changed = (b != np.sort(after, axis=1)).any(axis=1)
    return Plan(names, old_names, after[inv], before[inv], changed[inv], ranked,
                OwnerTable(new.epoch, names, ks, after))  # fmt: skip
