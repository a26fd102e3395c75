"""The eviction-policy interface every tier uses.

A policy only orders items; it never decides *when* to evict. The tier calls `victim()` when it
needs room, evicts (or demotes) the answer, then calls `remove()` on it. `victim()` may update
the policy's own aging state (a CLOCK hand, a FIFO promotion) but never forgets the item.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

__all__ = ["CAPACITY_ITEMS_MAX", "Evictable", "EvictionPolicy"]

Evictable = Callable[[int], bool]

# Tiers pass their block count (4 KiB blocks): 2**40 is a 4 PiB device. Capacity only sizes
# ghost lists, which hold ids that were actually evicted, so a large value costs nothing.
CAPACITY_ITEMS_MAX = 2**40


class EvictionPolicy(abc.ABC):
    """Orders cached items (integer ids) for eviction.

    `parent` is the chunk this one extends (the previous chunk of the prefix), or None for a
    root chunk; policies that do not use prefix structure ignore it. `now` is in seconds on any
    monotonic clock (the replay benchmark uses the trace's timestamps).
    """

    name: str = "abstract"

    def __init__(self, capacity: int) -> None:
        assert 0 < capacity <= CAPACITY_ITEMS_MAX, capacity
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, item: int, parent: int | None, now: float) -> None:
        """A new item was cached (a miss that was filled)."""

    @abc.abstractmethod
    def access(self, item: int, now: float) -> None:
        """A cached item was used again (a hit)."""

    @abc.abstractmethod
    def remove(self, item: int) -> None:
        """The item left the tier (evicted, demoted or deleted)."""

    @abc.abstractmethod
    def victim(self, evictable: Evictable) -> int | None:
        """The item to evict next among those with evictable(item) True; None if there is none."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, item: object) -> bool: ...
