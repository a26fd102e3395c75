"""ARC (Megiddo and Modha, FAST 2003): recency list T1, frequency list T2, their ghosts B1, B2.

The split `p` between T1 and T2 adapts: a miss that hits ghost B1 says recency was cut too
short (grow T1's target), one that hits B2 says the same of frequency.
"""

from __future__ import annotations

from collections import OrderedDict

from dpu_agent.eviction._policy import Evictable, EvictionPolicy

__all__ = ["ArcPolicy"]


class ArcPolicy(EvictionPolicy):
    """Adaptive Replacement Cache with item-count sizing."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._p = 0.0  # target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self, item
        c = self.capacity
        if item in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[item]
            self._t2[item] = None
        elif item in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[item]
            self._t2[item] = None
        else:
            self._t1[item] = None
        # Directory bounds of the paper: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def access(self, item: int, now: float) -> None:
        if item in self._t1:
            del self._t1[item]
        self._t2[item] = None
        self._t2.move_to_end(item)

    def remove(self, item: int) -> None:
        if item in self._t1:
            del self._t1[item]
            self._b1[item] = None
        else:
            del self._t2[item]
            self._b2[item] = None

    def victim(self, evictable: Evictable) -> int | None:
        first, second = (self._t1, self._t2)
        if not self._t1 or (len(self._t1) <= self._p and self._t2):
            first, second = second, first
        for queue in (first, second):
            for item in queue:
                if evictable(item):
                    return item
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, item: object) -> bool:
        return item in self._t1 or item in self._t2
