"""ExtentAllocator: best fit, coalescing, claiming in place, misuse errors."""

from __future__ import annotations

import numpy as np
import pytest

from dpu_agent.engine.alloc import AllocError, ExtentAllocator


def take(a: ExtentAllocator, n: int) -> int:
    lba = a.alloc(n)
    assert lba is not None, n
    return lba


def test_alloc_free_coalesces_neighbours() -> None:
    a = ExtentAllocator(100)
    x, y, z = take(a, 10), take(a, 10), take(a, 10)
    assert (x, y, z) == (0, 10, 20)
    assert a.free_blocks == 70
    a.free(x, 10)
    a.free(z, 10)
    assert a.extent_count == 2  # [0,10) and [20,100)
    a.free(y, 10)
    assert a.free_extents() == [(0, 100)]
    assert a.largest_free == 100


def test_best_fit_picks_smallest_hole() -> None:
    a = ExtentAllocator(100)
    starts = [take(a, 10) for _ in range(10)]
    a.free(starts[1], 10)  # hole of 10 at 10
    a.free(starts[5], 10)
    a.free(starts[6], 10)  # hole of 20 at 50
    assert a.alloc(8) == 10  # smallest hole that fits
    assert a.alloc(15) == 50
    assert a.alloc(30) is None


def test_alloc_at_and_from_used() -> None:
    a = ExtentAllocator(64)
    a.alloc_at(10, 5)
    a.alloc_at(0, 2)
    with pytest.raises(AllocError, match="not free"):
        a.alloc_at(12, 1)
    b = ExtentAllocator.from_used(64, np.array([10, 0]), np.array([5, 2]))
    assert b.free_extents() == a.free_extents() == [(2, 8), (15, 49)]
    with pytest.raises(AllocError, match="overlap"):
        ExtentAllocator.from_used(64, np.array([0, 3]), np.array([5, 5]))


def test_double_free_and_out_of_range_are_errors() -> None:
    a = ExtentAllocator(32)
    x = take(a, 4)
    a.free(x, 4)
    with pytest.raises(AllocError, match="double free"):
        a.free(x, 4)
    with pytest.raises(AllocError, match="outside"):
        a.free(30, 4)
    y = take(a, 8)
    a.free(y + 4, 4)
    with pytest.raises(AllocError, match="double free"):
        a.free(y, 8)
