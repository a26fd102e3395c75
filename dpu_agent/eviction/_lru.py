"""LRU and LRU-K (K=2, O'Neil, O'Neil and Weikum, SIGMOD 1993)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from dpu_agent.eviction._policy import (
    ADOPT_TIME_STEP_S,
    Evictable,
    EvictionPolicy,
    Ordering,
    Resident,
    last_of,
)

__all__ = ["Lru2Policy", "LruPolicy"]

NEG_INF = float("-inf")


class LruPolicy(EvictionPolicy):
    """Least recently used: the oldest access is evicted first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self._order, item
        self._order[item] = None

    def access(self, item: int, now: float) -> None:
        self._order.move_to_end(item)

    def remove(self, item: int) -> None:
        del self._order[item]

    def victim(self, evictable: Evictable) -> int | None:
        for item in self._order:
            if evictable(item):
                return item
        return None

    def resident_later(self, limit: int | None = None) -> Ordering:
        order = last_of(self._order.keys(), limit)
        return lambda: [(item, False) for item in order]  # LRU keeps no use counts

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order


class Lru2Policy(EvictionPolicy):
    """LRU-2: evict the item whose second-to-last reference is oldest.

    Items referenced once (no second-to-last reference, backward 2-distance infinite) go first,
    oldest first. References within `correlated_period_s` of the previous one are correlated
    (one burst of use) and do not count as a new reference. The reference history of evicted
    items is retained (bounded to `history_factor` x capacity entries) so an item that comes
    back is recognised as re-referenced.
    """

    name = "lru2"

    def __init__(
        self, capacity: int, *, correlated_period_s: float = 1.0, history_factor: int = 2
    ) -> None:
        super().__init__(capacity)
        assert correlated_period_s >= 0, correlated_period_s
        assert history_factor >= 0, history_factor
        self._crp_s = correlated_period_s
        self._history_max = history_factor * capacity
        # item -> [hist1 (last ref), hist2 (ref before it, -inf if none), last access time]
        self._items: dict[int, list[float]] = {}
        self._history: OrderedDict[int, tuple[float, float, float]] = OrderedDict()
        self._heap: list[tuple[float, float, int]] = []  # (hist2, hist1, item); lazy deletion

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self._items, item
        old = self._history.pop(item, None)
        if old is None:
            entry = [now, NEG_INF, now]
        elif now - old[2] <= self._crp_s:
            entry = [old[0], old[1], now]  # the eviction interrupted a correlated burst
        else:
            entry = [now, old[0], now]
        self._items[item] = entry
        self._push(item, entry)

    def access(self, item: int, now: float) -> None:
        entry = self._items[item]
        correlated = now - entry[2] <= self._crp_s
        entry[2] = now
        if not correlated:
            entry[1] = entry[0]
            entry[0] = now
            self._push(item, entry)

    def remove(self, item: int) -> None:
        entry = self._items.pop(item)
        if self._history_max > 0:
            self._history[item] = (entry[0], entry[1], entry[2])
            while len(self._history) > self._history_max:
                self._history.popitem(last=False)

    def victim(self, evictable: Evictable) -> int | None:
        skipped: list[tuple[float, float, int]] = []
        chosen: int | None = None
        while self._heap:
            top = heapq.heappop(self._heap)
            entry = self._items.get(top[2])
            if entry is None or entry[1] != top[0] or entry[0] != top[1]:
                continue  # stale
            skipped.append(top)
            if evictable(top[2]):
                chosen = top[2]
                break
        for top in skipped:
            heapq.heappush(self._heap, top)
        return chosen

    def resident_later(self, limit: int | None = None) -> Ordering:
        items, entries = list(self._items), list(self._items.values())  # no tuple per item

        def order() -> list[tuple[int, bool]]:
            keyed = sorted((e[1], e[0], item) for item, e in zip(items, entries, strict=True))
            hottest = keyed if limit is None else keyed[max(0, len(keyed) - limit) :]
            return [(item, second != NEG_INF) for second, _, item in hottest]

        return order

    def adopt(self, items: Sequence[Resident], now: float) -> None:
        """Items in the old order at increasing times just before `now`; a used item gets a
        second reference at its time too, so it goes after every item used once, as in
        LRU-2. No adopted time counts as a last access: the first real access after the
        handover is a new reference, not part of a correlated burst."""
        assert not self._items, len(self._items)
        t = now - ADOPT_TIME_STEP_S * (len(items) + 1)
        for item, _, used in items:
            t += ADOPT_TIME_STEP_S
            assert item not in self._items, item
            entry = [t, t if used else NEG_INF, NEG_INF]
            self._items[item] = entry
            self._push(item, entry)

    def _push(self, item: int, entry: list[float]) -> None:
        heapq.heappush(self._heap, (entry[1], entry[0], item))
        if len(self._heap) > 4 * len(self._items) + 64:
            self._heap = [(e[1], e[0], i) for i, e in self._items.items()]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items
