"""S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO and a ghost FIFO.

New items enter the small queue (about 10% of the capacity). One that is not used again before
it reaches the head is a one-hit wonder and leaves without ever disturbing the main queue; one
that was used moves to the main queue. An item that comes back while its id is still in the
ghost queue goes straight to the main queue. The main queue is a CLOCK with 2-bit counters.
"""

from __future__ import annotations

from collections import OrderedDict

from dpu_agent.eviction._policy import Evictable, EvictionPolicy, Ordering, last_of

__all__ = ["S3FifoPolicy"]

FREQ_MAX = 3  # 2-bit counters, as in the paper


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO with item-count sizing; victim() moves items between queues as the paper does."""

    name = "s3fifo"

    def __init__(self, capacity: int, *, small_fraction: float = 0.1) -> None:
        super().__init__(capacity)
        assert 0.0 < small_fraction < 1.0, small_fraction
        self._small_target = max(1, int(capacity * small_fraction))
        self._ghost_max = capacity  # ghost holds ids only: as many as the main queue
        self._small: OrderedDict[int, int] = OrderedDict()  # item -> freq
        self._main: OrderedDict[int, int] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self, item
        if item in self._ghost:
            del self._ghost[item]
            self._main[item] = 0
        else:
            self._small[item] = 0

    def access(self, item: int, now: float) -> None:
        queue = self._small if item in self._small else self._main
        queue[item] = min(FREQ_MAX, queue[item] + 1)

    def remove(self, item: int) -> None:
        if self._small.pop(item, None) is not None:
            self._ghost[item] = None
            while len(self._ghost) > self._ghost_max:
                self._ghost.popitem(last=False)
        else:
            del self._main[item]

    def victim(self, evictable: Evictable) -> int | None:
        # Bounded: each small item is looked at once per call before it moves to main, each
        # main item at most FREQ_MAX + 1 times before its counter reaches 0.
        queues = (self._small, self._main)
        skips = [0, 0]  # heads of each queue passed over because they were not evictable
        steps_max = len(self._small) + (FREQ_MAX + 2) * (len(self._small) + len(self._main))
        for _ in range(steps_max):
            small_done, main_done = skips[0] >= len(self._small), skips[1] >= len(self._main)
            if small_done and main_done:
                return None
            use_small = len(self._small) >= self._small_target or not self._main
            use_small = (use_small and not small_done) or main_done
            queue = queues[not use_small]
            item, freq = next(iter(queue.items()))
            if not evictable(item):
                skips[not use_small] += 1
                queue.move_to_end(item)
            elif freq == 0:
                return item
            elif use_small:
                del queue[item]
                self._main[item] = 0
            else:
                queue[item] = freq - 1
                queue.move_to_end(item)
        # Unreachable by the bound above; a linear scan keeps the contract if it ever is not.
        return next((i for q in queues for i in q if evictable(i)), None)

    def resident_later(self, limit: int | None = None) -> Ordering:
        # the small queue first (it is evicted from first), each queue head first; an item in
        # the main queue got there by being used (or by coming back while remembered)
        # (keys and values apart: a list of pairs would allocate a tuple per item under the lock)
        main = last_of(self._main.keys(), limit)
        rest = None if limit is None else limit - len(main)
        small, freqs = last_of(self._small.keys(), rest), last_of(self._small.values(), rest)
        return lambda: (
            [(i, f > 0) for i, f in zip(small, freqs, strict=True)] + [(i, True) for i in main]
        )

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, item: object) -> bool:
        return item in self._small or item in self._main
