"""The eviction-policy interface every tier uses.

A policy only orders items; it never decides *when* to evict. The tier calls `victim()` when it
needs room, evicts (or demotes) the answer, then calls `remove()` on it. `victim()` may update
the policy's own aging state (a CLOCK hand, a FIFO promotion) but never forgets the item.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Reversible, Sequence
from itertools import islice
from typing import Any, TypeVar

__all__ = [
    "CAPACITY_ITEMS_MAX",
    "Evictable",
    "EvictionPolicy",
    "Ordering",
    "Resident",
    "last_of",
]

Evictable = Callable[[int], bool]
# A held item handed from one policy to another: (item, parent or None, used since it came in)
Resident = tuple[int, int | None, bool]
# `resident()` to be computed later: what `resident_later()` returns
Ordering = Callable[[], list[tuple[int, bool]]]

# Tiers pass their block count (4 KiB blocks): 2**40 is a 4 PiB device. Capacity only sizes
# ghost lists, which hold ids that were actually evicted, so a large value costs nothing.
CAPACITY_ITEMS_MAX = 2**40
# Adopted items get times this far apart, just before the adoption: far above a float's
# resolution at any clock reading below 10^6 s, far below the time between two requests.
ADOPT_TIME_STEP_S = 1e-7


_T = TypeVar("_T")


def last_of(view: Reversible[_T], limit: int | None) -> list[_T]:
    """The last `limit` of an ordered view (an OrderedDict's keys or values), in its order;
    all of it if `limit` is None. Read from the end, so only those `limit` are touched: an
    OrderedDict's order is a linked list, and walking a million scattered nodes under a lock
    took 0.67 s on the development box (`dpuctl bench recovery`, `order_copy_ms`)."""
    if limit is None:
        return list(view)
    out = list(islice(reversed(view), limit))
    out.reverse()
    return out


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

    def resident(self) -> list[tuple[int, bool]]:
        """The items held, the first to go first (oldest, least used), each with whether it
        was used since it came in: what another policy needs to take the tier over without
        flushing it (`adopt`). Only the policies an election can hand a tier from have it."""
        return self.resident_later()()

    def resident_later(self, limit: int | None = None) -> Ordering:
        """`resident()` in two steps, for a caller that holds a lock now and orders after it
        lets go (the engine's periodic save of the order, `engine/_restart_order.py`): this
        call takes only shallow copies of what the order is computed from (O(n) in C, no
        Python work per item); the function it returns does the ordering. An item touched
        between the two is ordered by its newer state: the result is a hint, never a victim.
        With `limit`, only the `limit` last to go (the hottest), still first to go first; a
        policy that keeps its items in eviction order (`lru`, `s3fifo`) copies only those."""
        raise NotImplementedError(f"{self.name} cannot hand its items to another policy")

    def state(self) -> dict[str, Any]:
        """What a restarted tier's policy begins from (`restore`), as JSON: the engine keeps
        it beside its checkpoint. Most policies keep nothing across a restart."""
        return {}

    def restore(self, state: Mapping[str, Any], now: float) -> None:
        """Begin from what `state()` returned in an earlier run of this tier (the engine calls
        it at open, after recovery). Anything it does not recognise is ignored."""
        return None  # nothing kept, nothing to begin from

    def adopt(self, items: Sequence[Resident], now: float) -> None:
        """Take over a tier's contents (this policy empty): `items` in `resident()`'s order.

        Replays them as inserts (a parent before its children, so prefix structure holds) and
        a use for each one that was used, at increasing times just before `now`, so the first
        to go under the old policy is the oldest here too."""
        assert len(self) == 0, len(self)
        parents = {item: parent for item, parent, _ in items}
        step = ADOPT_TIME_STEP_S
        t = now - step * (len(items) + 1)
        for item, _, used in items:
            t += step
            if item not in self:
                chain = [item]  # its held ancestors not yet inserted, nearest first
                on_chain = {item}  # a link that loops back (a client that put A under B,
                up = parents.get(item)  # then B under A) ends the chain
                while up is not None and up not in self and up in parents and up not in on_chain:
                    chain.append(up)
                    on_chain.add(up)
                    up = parents.get(up)
                for i in reversed(chain):
                    if i not in self:
                        p = parents[i]
                        self.insert(i, p if p is not None and p in self else None, t)
            if used:
                self.access(item, t)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, item: object) -> bool: ...
