"""`prefix`: prefix-aware eviction over an adaptive recency/frequency split (ARC); the default
`prefix-run` (`_prefix_run.py`) builds on it.

Why this shape (docs/EVICTION.md has the measurements):
- A chunk is useless without its parent, and every request that uses a chunk uses its whole
  prefix, so a parent is always at least as valuable as any of its children. Only leaves (items
  with no cached child) are candidates; a parent becomes one when its last child leaves. A
  parent goes before its children only when no leaf is evictable (pins, leases).
- Items seen once (probation) and items seen again (protected) are kept apart, as in ARC and
  S3-FIFO: the new tail of every prompt and one-off documents land in probation and leave from
  there without pushing out shared prefixes that earned their place.
- How much room probation gets is learnt, as in ARC: a returning id that was evicted from
  probation (ghost list B1) says new items were cut short, one evicted from protected (B2) says
  the opposite. Conversations (whose newest turn is reused soon) and document QA (where
  popularity wins) need opposite splits; a fixed split is wrong for one of them.
- Within each class the least recently used leaf goes first; ties (the blocks of one request
  share a timestamp) evict the deeper block first.
Each class keeps a heap of its leaves only, with lazy deletion, so victim() is O(log n). The
split and the ghost lists scale with the items held, not with the `capacity` hint.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from dpu_agent.eviction._policy import Evictable, EvictionPolicy, Ordering, Resident

__all__ = ["PrefixPolicy"]

HEAP_SLACK_FACTOR = 4  # stale heap entries allowed per live item before the heaps are rebuilt
# Probation's starting share of the items held; ARC's step moves it by about one item per ghost
# hit, so a cache that turns over only a few times keeps close to where it started. S3-FIFO's
# 10% left `prefix` under LRU on large caches of conversations (each turn's new blocks wait in
# probation for the next turn); on the development data 25% had none under LRU and more cells
# within the bar (docs/EVICTION.md, "Probation's starting share"). `prefix-run` keeps 10%.
PROBATION_START = 0.25
_Entry = tuple[float, int, int, int]  # (last access, -depth, seq, item)


class _Node:
    __slots__ = (
        "children", "depth", "last", "parent", "parent_node", "penalised", "protected", "run",
        "seq",
    )  # fmt: skip

    def __init__(
        self, parent: int | None, parent_node: _Node | None, now: float, protected: bool
    ) -> None:
        # The parent's node object, not just its id: if the parent leaves the tier (a demotion,
        # a pinned child) and comes back, the count belongs to the node that was counted.
        self.parent = parent
        self.parent_node = parent_node
        self.depth: int = 0 if parent_node is None else parent_node.depth + 1
        self.last = now
        self.protected = protected
        self.children = 0
        self.seq = 0
        self.run = 0  # RunAwarePrefixPolicy: blocks missed in a row up to this one
        self.penalised = False  # RunAwarePrefixPolicy: entered already old


class PrefixPolicy(EvictionPolicy):
    """Leaf-first eviction; probation vs protected split adapted by ghost hits (ARC).

    `probation_fraction` is the starting share of probation (PROBATION_START); `adaptive=False`
    keeps it fixed. Ghost lists hold `ghost_factor` times the items held (ARC: 1).
    """

    name = "prefix"

    def __init__(
        self,
        capacity: int,
        *,
        adaptive: bool = True,
        probation_fraction: float = PROBATION_START,
        ghost_factor: float = 1.0,
    ) -> None:
        super().__init__(capacity)
        assert 0.0 <= probation_fraction <= 1.0, probation_fraction
        assert ghost_factor >= 0.0, ghost_factor
        self._ghost_factor = ghost_factor
        self._adaptive = adaptive
        # ARC's p as a share of the items held, not of `capacity`: a tier that passes its block
        # count (several blocks per chunk) still gets the split it learns.
        self._share = probation_fraction
        self._nodes: dict[int, _Node] = {}
        self._heaps: tuple[list[_Entry], list[_Entry]] = ([], [])  # probation, protected
        self._counts = [0, 0]
        self._ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._seq = 0
        self._heaps_deferred = False  # during `adopt`: the heaps are built once, at its end

    def adopt(self, items: Sequence[Resident], now: float) -> None:
        """`EvictionPolicy.adopt`, with the heaps built once at the end (O(n)) instead of a
        push per insert and use: they hold the same live entries, so every victim after is
        the same (a restart hands back up to 2^17 items before the agent serves)."""
        self._heaps_deferred = True
        try:
            super().adopt(items, now)
        finally:
            self._heaps_deferred = False
            self._rebuild(False)
            self._rebuild(True)

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self._nodes, item
        protected = self._ghost_hit(item)
        pnode = self._nodes.get(parent) if parent is not None else None
        node = _Node(parent, pnode, now, protected)
        self._nodes[item] = node
        self._counts[protected] += 1
        if pnode is not None:
            pnode.children += 1
        self._push(item, node)
        self._trim_ghosts()

    def access(self, item: int, now: float) -> None:
        node = self._nodes[item]
        node.last = now
        if not node.protected:
            node.protected = True
            self._counts[0] -= 1
            self._counts[1] += 1
        if node.children == 0:
            self._push(item, node)

    def remove(self, item: int) -> None:
        node = self._nodes.pop(item)
        self._counts[node.protected] -= 1
        self._ghosts[node.protected][item] = None
        pnode = node.parent_node
        if pnode is not None:
            pnode.children -= 1
            assert pnode.children >= 0, (node.parent, pnode.children)
            if pnode.children == 0 and node.parent is not None:
                if self._nodes.get(node.parent) is pnode:  # still cached: now a leaf
                    self._push(node.parent, pnode)

    def victim(self, evictable: Evictable) -> int | None:
        over = self._counts[0] > self._share * len(self._nodes)
        first = 0 if over or self._counts[1] == 0 else 1
        for cls in (first, 1 - first):
            chosen = self._leaf_victim(self._heaps[cls], evictable)
            if chosen is not None:
                return chosen
        return self._any_victim(evictable)

    def resident_later(self, limit: int | None = None) -> Ordering:
        items, nodes = list(self._nodes), list(self._nodes.values())

        def order() -> list[tuple[int, bool]]:  # by (last, -depth, seq), as the heaps evict
            import numpy as np  # here: reading the config imports this package (dpuctl status)

            n = len(nodes)
            if limit is not None and limit <= 0:
                return []
            last = np.fromiter((node.last for node in nodes), np.float64, n)
            picked = np.arange(n)
            if limit is not None and limit < n:  # only items at least as recent as the limit-th
                picked = np.flatnonzero(last >= np.partition(last, n - limit)[n - limit])
            chosen = [nodes[i] for i in picked.tolist()]
            depth = np.fromiter((node.depth for node in chosen), np.int64, len(chosen))
            seq = np.fromiter((node.seq for node in chosen), np.int64, len(chosen))
            ranked = picked[np.lexsort((seq, -depth, last[picked]))]
            hottest = ranked if limit is None else ranked[max(0, len(ranked) - limit) :]
            return [(items[i], nodes[i].protected) for i in hottest.tolist()]

        return order

    def _ghost_hit(self, item: int) -> bool:
        """ARC's adaptation on a miss; True if the item returns straight to protected."""
        b1, b2 = self._ghosts
        if item in b1:
            del b1[item]
            if self._adaptive:
                step = max(len(b2) / (len(b1) + 1), 1.0)
                self._share = min(1.0, self._share + step / max(1, len(self._nodes)))
            return True
        if item in b2:
            del b2[item]
            if self._adaptive:
                step = max(len(b1) / (len(b2) + 1), 1.0)
                self._share = max(0.0, self._share - step / max(1, len(self._nodes)))
            return True
        return False

    def _trim_ghosts(self) -> None:
        """ARC's directory bounds: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c."""
        b1, b2 = self._ghosts
        held = min(len(self._nodes), self.capacity)  # the tier's real size once it is full
        ghost_max = self._ghost_factor * held
        while b1 and self._counts[0] + len(b1) > ghost_max:
            b1.popitem(last=False)
        while b2 and len(self._nodes) + len(b1) + len(b2) > held + ghost_max:
            b2.popitem(last=False)

    def _leaf_victim(self, heap: list[_Entry], evictable: Evictable) -> int | None:
        skipped: list[_Entry] = []
        chosen: int | None = None
        while heap:
            entry = heapq.heappop(heap)
            node = self._nodes.get(entry[3])
            if node is None or node.seq != entry[2] or node.children != 0:
                continue  # stale: gone, touched since, or no longer a leaf
            skipped.append(entry)
            if evictable(entry[3]):
                chosen = entry[3]
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return chosen

    def _any_victim(self, evictable: Evictable) -> int | None:
        """No leaf is evictable (children pinned): the oldest evictable item. O(n), rare."""
        candidates = [(n.last, -n.depth, i) for i, n in self._nodes.items() if evictable(i)]
        return min(candidates)[2] if candidates else None

    def _push(self, item: int, node: _Node) -> None:
        self._seq += 1
        node.seq = self._seq
        if self._heaps_deferred:
            return
        heap = self._heaps[node.protected]
        heapq.heappush(heap, (node.last, -node.depth, node.seq, item))
        if len(heap) > HEAP_SLACK_FACTOR * len(self._nodes) + 64:
            self._rebuild(node.protected)

    def _rebuild(self, protected: bool) -> None:
        heap = [
            (n.last, -n.depth, n.seq, i)
            for i, n in self._nodes.items()
            if n.children == 0 and n.protected == protected
        ]
        heapq.heapify(heap)
        self._heaps[protected][:] = heap

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, item: object) -> bool:
        return item in self._nodes
