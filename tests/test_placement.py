"""Weighted rendezvous placement: determinism, minimal movement on join/leave, balance,
weights, zones, replicas and the membership epoch."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.placement import Node, Placement, keys64, membership_epoch


def nodes(n: int, **kw: object) -> list[Node]:
    return [Node(name=f"node-{i:04d}", **kw) for i in range(n)]  # type: ignore[arg-type]


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest() for i in range(n)]


K64 = keys64(keys(40_000))


def test_same_owners_whatever_the_member_order() -> None:
    a = nodes(12)
    b = list(a)
    random.Random(1).shuffle(b)
    pa, pb = Placement(a), Placement(b)
    assert pa.epoch == pb.epoch
    ks = keys(500)
    assert [[n.name for n in o] for o in pa.owners_batch(ks, 3)] == [
        [n.name for n in o] for o in pb.owners_batch(ks, 3)
    ]
    assert [n.name for n in pa.owners(ks[7], 2)] == [n.name for n in pa.owners_batch(ks, 2)[7]]


@pytest.mark.parametrize("n", [4, 16, 64])
def test_join_moves_only_keys_the_new_node_now_owns_about_one_over_n(n: int) -> None:
    before = Placement(nodes(n))
    after = Placement([*nodes(n), Node(name="newcomer")])
    a = np.array([x.name for x in before.serving])[before.primary_index(K64)]
    b = np.array([x.name for x in after.serving])[after.primary_index(K64)]
    moved = a != b
    assert set(b[moved]) == {"newcomer"}  # nothing moves between old nodes
    ideal = 1 / (n + 1)
    assert abs(moved.mean() - ideal) < 0.1 * ideal + 3 * np.sqrt(ideal / len(K64))


@pytest.mark.parametrize("n", [4, 16, 64])
def test_leave_moves_only_the_leaving_nodes_keys(n: int) -> None:
    all_nodes = nodes(n)
    before, after = Placement(all_nodes), Placement(all_nodes[1:])
    a = np.array([x.name for x in before.serving])[before.primary_index(K64)]
    b = np.array([x.name for x in after.serving])[after.primary_index(K64)]
    moved = a != b
    assert set(a[moved]) == {all_nodes[0].name}
    assert moved.sum() == (a == all_nodes[0].name).sum()


def test_a_leaving_member_owns_nothing_but_stays_listed() -> None:
    ns = [*nodes(3), Node(name="going", state="leaving"), Node(name="coming", state="joining")]
    p = Placement(ns)
    assert len(p) == 3 and len(p.nodes) == 5
    assert {o[0].name for o in p.owners_batch(keys(300))} == {n.name for n in nodes(3)}


def test_equal_weights_balance_within_ten_percent() -> None:
    p = Placement(nodes(16))
    counts = np.bincount(p.primary_index(K64), minlength=16)
    assert counts.max() / counts.mean() <= 1.1, counts


def test_weights_give_proportional_shares() -> None:
    ns = [Node(name=f"n{i}", capacity_bytes=(2 if i == 0 else 1) << 30) for i in range(8)]
    p = Placement(ns)
    counts = np.bincount(p.primary_index(K64), minlength=8)
    share0 = counts[0] / counts.sum()
    assert abs(share0 - 2 / 9) < 0.02, counts


def test_replicas_distinct_and_zone_aware() -> None:
    ns = [Node(name=f"n{i}", zone=f"z{i % 3}") for i in range(9)]
    p = Placement(ns)
    for owners in p.owners_batch(keys(400), 3):
        assert len({o.name for o in owners}) == 3
        assert len({o.zone for o in owners}) == 3
    two_zones = [Node(name=f"m{i}", zone=f"z{i % 2}") for i in range(6)]
    for owners in Placement(two_zones).owners_batch(keys(200), 3):
        assert len({o.name for o in owners}) == 3 and len({o.zone for o in owners}) == 2
    # the first owner is the same as without replicas: reads of R=1 data find it
    first = [o[0].name for o in p.owners_batch(keys(400), 1)]
    assert first == [o[0].name for o in p.owners_batch(keys(400), 3)]


def test_more_replicas_than_nodes_gives_every_node() -> None:
    p = Placement(nodes(2))
    assert len(p.owners(keys(1)[0], 5)) == 2
    assert Placement([]).owners(keys(1)[0], 2) == []


def test_epoch_changes_with_members_tags_and_state() -> None:
    base = nodes(4)
    e = membership_epoch(base)
    assert membership_epoch([*base, Node(name="x")]) != e
    assert membership_epoch([*base[:3], Node(name=base[3].name, state="leaving")]) != e
    assert membership_epoch([*base[:3], Node(name=base[3].name, capacity_bytes=7)]) != e
    assert 0 <= e < (1 << 63)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.integers(0, 1000))
def test_property_join_then_leave_restores_every_owner(n: int, seed: int) -> None:
    ks = keys64(keys(300, seed))
    base = nodes(n)
    p0 = Placement(base)
    p1 = Placement([*base, Node(name=f"extra-{seed}")])
    p2 = Placement(base)
    assert np.array_equal(p0.primary_index(ks), p2.primary_index(ks))
    names1 = np.array([x.name for x in p1.serving])[p1.primary_index(ks)]
    names0 = np.array([x.name for x in p0.serving])[p0.primary_index(ks)]
    assert set(names1[names1 != names0]) <= {f"extra-{seed}"}
