"""Fragmentation bound of the extent allocator under random churn (the bound in alloc.py)."""

from __future__ import annotations

import random

from dpu_agent.engine.alloc import ExtentAllocator

BLOCKS = 1 << 14
SIZE_MAX = 64  # S: requests of 1..S blocks


def _churn(
    seed: int, steps: int, fill_max: float, *, check_largest: bool
) -> list[tuple[int, int, int]]:
    """Random alloc/free at up to fill_max occupancy; returns (free, largest, request) samples
    taken whenever a request failed."""
    rng = random.Random(seed)
    a = ExtentAllocator(BLOCKS)
    live: list[tuple[int, int]] = []
    failures: list[tuple[int, int, int]] = []
    for _ in range(steps):
        if live and (a.used_blocks > fill_max * BLOCKS or rng.random() < 0.45):
            a.free(*live.pop(rng.randrange(len(live))))
            continue
        n = rng.randint(1, SIZE_MAX)
        got = a.alloc(n)
        if got is None:
            failures.append((a.free_blocks, a.largest_free, n))
        else:
            live.append((got, n))
        if check_largest and a.free_blocks >= BLOCKS // 20:  # at every point, not only failures
            assert a.largest_free * 5 >= a.free_blocks * 2, (a.largest_free, a.free_blocks)
    assert a.free_blocks + sum(n for _, n in live) == BLOCKS
    return failures


def test_mixed_size_churn_at_75_percent_never_fails_and_keeps_large_extents() -> None:
    for seed in range(3):
        assert _churn(seed, 30_000, 0.75, check_largest=True) == []


def test_mixed_size_churn_at_90_percent_fails_only_with_little_free_space() -> None:
    """Near full, fragmentation can refuse a request; the engine then evicts more victims.
    Measured worst case: 10% of the tier free (1690 of 16384 blocks) and no extent of 64."""
    for seed in range(3):
        for free, _largest, request in _churn(seed, 30_000, 0.9, check_largest=False):
            assert free < BLOCKS // 8, (seed, free, request)


def test_uniform_sizes_never_fragment() -> None:
    rng = random.Random(5)
    a = ExtentAllocator(1000)
    live: list[tuple[int, int]] = []
    for _ in range(20_000):
        if live and rng.random() < 0.5:
            a.free(*live.pop(rng.randrange(len(live))))
        else:
            got = a.alloc(8)
            if got is None:
                assert a.free_blocks < 8  # any 8 free blocks would be one extent
            else:
                live.append((got, 8))
