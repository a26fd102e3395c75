"""What a view change means for the keys one node holds, at a cost proportional to the keys
whose owners changed.

`OwnerTable` remembers, for every key the node held at the last settled pass, its owners
under that view (indexes into the view's serving names). On a new view, `plan` reuses every
row it can: with equal weights and no zones (Placement.delta_safe) a key's owners change only
when a joined node outranks the key's R-th owner or a gone node was one of them, which one
vectorised hash column per joined node and one comparison per gone node decide; only those
keys, and keys the table has not seen yet, get a full rendezvous ranking (O(N) each). Weighted
or zoned views rank every key again (documented in docs/CLUSTER.md).
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
    """For the keys given to `plan`: owners now, owners under the settled view (None for a
    node with no settled view), and which keys' owner sets changed."""

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
    if settled is None:
        after = _full(new, k64, r)
        t = _table(new, names, k64, after)
        return Plan(names, (), after, None, np.ones(n, dtype=bool), n, t)
    old_names = tuple(x.name for x in settled.serving)
    before = np.full((n, r), -1, dtype=np.int32)
    known = np.zeros(n, dtype=bool)
    if table is not None and table.epoch == settled.epoch and len(table.k64):
        pos = np.searchsorted(table.k64, k64)
        pos_c = np.minimum(pos, len(table.k64) - 1)
        known = table.k64[pos_c] == k64
        before[known] = _reindex(table.owners[pos_c[known]], table.names, old_names)
    unknown = ~known
    before[unknown] = _full(settled, k64[unknown], r)
    ranked = int(unknown.sum())
    after = np.full((n, r), -1, dtype=np.int32)
    flag = unknown.copy()
    common_same = (
        settled.delta_safe and new.delta_safe and all(a == b for a, b in _common(settled, new))
    )
    if common_same:
        joined = [x for x in names if x not in old_names]
        gone_idx = [i for i, x in enumerate(old_names) if x not in names]
        full_old = len(old_names) >= r  # fewer nodes than R: any join adds an owner
        kn = np.flatnonzero(known)
        rows = before[kn]
        if joined and not full_old:
            flag[kn] = True
        elif joined:
            rth = _rth_hash(settled, k64[kn], rows[:, -1], old_names)
            for j in joined:
                flag[kn] |= new.hash_column(k64[kn], j) > rth
        for g in gone_idx:
            flag[kn] |= (rows == g).any(axis=1)
        keep = known & ~flag
        after[keep] = _reindex(before[keep], old_names, names)
    else:
        flag[:] = True
    after[flag] = _full(new, k64[flag], r)
    ranked += int(flag.sum())
    changed = _sets_differ(before, old_names, after, names)
    return Plan(names, old_names, after, before, changed, ranked,
                _table(new, names, k64, after))  # fmt: skip


def _rth_hash(p: Placement, k64: np.ndarray, rth: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Each key's score at its R-th owner (equal weights: the raw hash), one column per node."""
    out = np.zeros(len(k64), dtype=np.uint64)
    for i, name in enumerate(names):
        sel = rth == i
        if sel.any():
            out[sel] = p.hash_column(k64[sel], name)
    return out


def _common(a: Placement, b: Placement) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    bn = {n.name: n for n in b.serving}
    return [((n.capacity_bytes, n.zone), (bn[n.name].capacity_bytes, bn[n.name].zone))
            for n in a.serving if n.name in bn]  # fmt: skip


def _sets_differ(
    before: np.ndarray, bn: tuple[str, ...], after: np.ndarray, an: tuple[str, ...]
) -> np.ndarray:
    b = np.sort(_reindex(before, bn, an), axis=1)
    return (b != np.sort(after, axis=1)).any(axis=1)


def _table(p: Placement, names: tuple[str, ...], k64: np.ndarray, owners: np.ndarray) -> OwnerTable:
    order = np.argsort(k64, kind="stable")
    return OwnerTable(p.epoch, names, k64[order], owners[order])
