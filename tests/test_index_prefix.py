"""RecordIndex.find_prefix against find(): scalar probes, then the numpy batch past them."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.engine.index import NO_ROW, PREFIX_SCALAR_MAX, RecordIndex


def _model_prefix(index: RecordIndex, tenant: int, keys: list[bytes]) -> list[int]:
    rows = []
    for k in keys:
        row = index.find(tenant, k)
        if row == NO_ROW:
            break
        rows.append(row)
    return rows


@settings(max_examples=60, deadline=None)
@given(present=st.integers(0, 3 * PREFIX_SCALAR_MAX), miss_at=st.integers(0, 4 * PREFIX_SCALAR_MAX))
def test_find_prefix_matches_find(present: int, miss_at: int) -> None:
    rng = random.Random(present * 1000 + miss_at)
    index = RecordIndex()
    keys = [rng.randbytes(16) for _ in range(present)]
    for i, k in enumerate(keys):
        index.insert(1, k, lba=i)
    index.insert(2, rng.randbytes(16), lba=0)  # another tenant's record: never a hit for 1
    asked = [*keys[:miss_at], rng.randbytes(16), *keys[miss_at:]]
    blob = b"".join(asked)
    assert index.find_prefix(1, blob) == _model_prefix(index, 1, asked)
    assert index.find_prefix(2, b"".join(keys)) == []
    assert index.find_prefix(1, b"") == []
