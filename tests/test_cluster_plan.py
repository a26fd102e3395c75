"""The rebalancer's pure parts: a view change ranks only the keys whose owners changed (and
gets the same owners as ranking everything); N senders share one receiver's rate; replica
digests agree exactly when (key, checksum) sets agree."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dpu_agent.cluster._plan import plan
from dpu_agent.cluster._rebalance import AE_BUCKETS, ReceiveLimiter, digest
from kvproto.placement import Node, Placement


def nodes(names: list[str], **kw: object) -> Placement:
    return Placement([Node(name=n, **kw) for n in names])  # type: ignore[arg-type]


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize(
    "after",
    [
        ["n0", "n1", "n2", "n3", "n4", "n5"],  # a join
        ["n0", "n1", "n3", "n4"],  # a leave
        ["n0", "n1", "n2", "n3", "n5", "n6"],  # one gone, two new
    ],
)
def test_view_change_ranks_only_keys_whose_owners_changed(r: int, after: list[str]) -> None:
    """Regression: every view change ranked every key against every member (twice)."""
    k64 = np.random.default_rng(r).integers(0, 1 << 63, 50_000, dtype=np.uint64)
    old, new = nodes(["n0", "n1", "n2", "n3", "n4"]), nodes(after)
    settled = plan(k64, r, old, None, None)
    p = plan(k64, r, new, old, settled.table)
    assert (p.after == new.owner_index(k64, r)).all()  # the same owners as ranking all
    before = old.owner_index(k64, r)
    names_old = [n.name for n in old.serving]
    names_new = [n.name for n in new.serving]
    want = np.array([{names_old[j] for j in b} != {names_new[j] for j in a}
                     for b, a in zip(before, p.after, strict=True)])  # fmt: skip
    assert (p.changed == want).all()
    assert p.ranked == int(want.sum()) < len(k64)  # proportional to the changed keys
    again = plan(k64, r, new, new, p.table)  # settled at the new view: nothing to rank
    assert again.ranked == 0 and not again.changed.any()


def test_weighted_views_rank_everything_and_still_agree() -> None:
    k64 = np.random.default_rng(5).integers(0, 1 << 63, 5_000, dtype=np.uint64)
    old = Placement([Node(name=f"w{i}", capacity_bytes=1 + i) for i in range(4)])
    new = Placement([Node(name=f"w{i}", capacity_bytes=1 + i) for i in range(5)])
    p = plan(k64, 2, new, old, plan(k64, 2, old, None, None).table)
    assert p.ranked == len(k64) and (p.after == new.owner_index(k64, 2)).all()


def test_receivers_rate_is_shared_by_all_senders() -> None:
    """Regression: a joiner took N x the per-sender rate (no receive-side limit)."""
    lim = ReceiveLimiter(1000.0)
    waits = [lim.grant(500) for _ in range(4)]  # four senders, 500 bytes each, at once
    assert waits[-1] == pytest.approx(2.0, abs=0.05)  # 2,000 bytes at 1,000 B/s
    time.sleep(0.05)
    assert lim.grant(100) == pytest.approx(2.05, abs=0.1)


def test_digests_differ_exactly_where_versions_differ() -> None:
    rng = np.random.default_rng(3)
    k64, k1, c0, c1 = (rng.integers(0, 1 << 63, 1000, dtype=np.uint64) for _ in range(4))
    d = digest(k64, k1, c0, c1)
    assert len(d) == AE_BUCKETS
    order = rng.permutation(1000)
    assert digest(k64[order], k1[order], c0[order], c1[order]) == d  # order-free
    c0b = c0.copy()
    c0b[17] ^= np.uint64(1)
    d2 = digest(k64, k1, c0b, c1)
    assert [b for b in range(AE_BUCKETS) if d[b] != d2[b]] == [int(k64[17] >> np.uint64(56))]
