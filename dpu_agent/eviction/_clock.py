"""CLOCK with decayed frequency counters: recency and frequency, aged by time.

Each item carries a score: +1 per access, decaying by half every `half_life_s` seconds of
clock time, saturating at `SCORE_MAX`. The hand sweeps the ring; an item whose decayed score is
below 1 is the victim, any other item has its score halved (its second chance) and the hand
moves on. A conversation whose turns keep coming keeps its chunks warm; one that went quiet
decays within a few half-lives however popular it was, which plain LFU never forgets.
"""

from __future__ import annotations

from collections import OrderedDict

from dpu_agent.eviction._policy import Evictable, EvictionPolicy

__all__ = ["ClockPolicy"]

# Saturating counter, like CLOCK-Pro's and S3-FIFO's: 8 halvings bring any item back to
# evictable, which bounds one sweep.
SCORE_MAX = 255.0
SWEEP_ROUNDS_MAX = 10  # > log2(SCORE_MAX) + 1: every evictable item qualifies by then


class ClockPolicy(EvictionPolicy):
    """CLOCK over an ordered ring, with time-decayed frequency scores."""

    name = "clock"

    def __init__(self, capacity: int, *, half_life_s: float = 120.0) -> None:
        super().__init__(capacity)
        assert half_life_s > 0, half_life_s
        self._half_life_s = half_life_s
        self._now = 0.0
        # item -> [score, time of score]; ring order = dict order, the hand is the front
        self._ring: OrderedDict[int, list[float]] = OrderedDict()

    def insert(self, item: int, parent: int | None, now: float) -> None:
        assert item not in self._ring, item
        self._now = max(self._now, now)
        self._ring[item] = [0.0, now]  # no second chance until it is used again

    def access(self, item: int, now: float) -> None:
        self._now = max(self._now, now)
        entry = self._ring[item]
        entry[0] = min(SCORE_MAX, self._decayed(entry) + 1.0)
        entry[1] = now

    def remove(self, item: int) -> None:
        del self._ring[item]

    def victim(self, evictable: Evictable) -> int | None:
        steps_max = SWEEP_ROUNDS_MAX * len(self._ring)
        for _ in range(steps_max):
            item, entry = next(iter(self._ring.items()))
            if evictable(item):
                score = self._decayed(entry)
                if score < 1.0:
                    return item
                entry[0] = score / 2.0
                entry[1] = self._now
            self._ring.move_to_end(item)
        return None  # nothing evictable: every lap skipped every item

    def _decayed(self, entry: list[float]) -> float:
        age_s = self._now - entry[1]
        if age_s <= 0:
            return entry[0]
        return entry[0] * 0.5 ** (age_s / self._half_life_s)

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, item: object) -> bool:
        return item in self._ring
