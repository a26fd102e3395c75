"""`elect`: a leader among a few candidates, chosen by sampled shadows. Its behaviour, through
its public face only: it switches when one candidate is clearly better and not when they tie,
a switch keeps every held item (the new leader adopts them), its shadows hold a bounded number
of items at a bounded sampling rate, and the sample follows the item, so a chunk that leaves
and comes back is the same sample member."""

from __future__ import annotations

import operator
import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from dpu_agent.bench.replay import Request, replay_hits, replay_request
from dpu_agent.bench.replay_engine import replay_engine
from dpu_agent.eviction import ElectPolicy, _registry, make_policy
from dpu_agent.eviction._elect import SHADOW_ITEMS_MAX, SHADOW_ITEMS_MIN


def _hot_and_scans(
    requests: int, *, hot: int = 40, every: int = 3, gap_ms: float = 1.0, seed: int = 7
) -> list[Request]:
    """One-block requests `gap_ms` apart: a hot set of `hot` blocks, one of them every `every`th
    request, between scans of never-seen blocks. By default (40, every third, 1 ms) S3-FIFO keeps
    the hot set (scans leave from its small queue) and LRU lets every scan push it out."""
    rng = random.Random(seed)
    out: list[Request] = []
    fresh = 1_000_000
    for k in range(requests):
        if k % every == 0:
            block = rng.randrange(hot)
        else:
            fresh += 1
            block = fresh
        out.append(Request(timestamp_ms=gap_ms * k, hash_ids=(block,)))
    return out


def _hot_and_scans_slow(requests: int) -> list[Request]:
    """30 hot blocks, every fourth request, a second apart: LRU-2 ranks a block by its
    second-to-last use, so the hot set outlives the scans; LRU lets them push it out. (A
    second apart: LRU-2 takes uses within 1 s of each other as one.)"""
    return _hot_and_scans(requests, hot=30, every=4, gap_ms=1000.0, seed=5)


def _tracked_replay(policy: ElectPolicy, trace: list[Request], capacity: int) -> set[int]:
    """Replay `trace`, checking after every request that the policy holds exactly what was
    inserted and not removed, and that its leader's order covers exactly those items."""
    held: set[int] = set()
    switches = policy.switches
    for req in trace:
        parent = None
        for b in req.hash_ids:
            if b in policy:
                policy.access(b, req.timestamp_ms / 1000.0)
            else:
                if len(policy) >= capacity:
                    victim = policy.victim(partial(operator.ne, parent))
                    assert victim in held
                    policy.remove(victim)
                    held.discard(victim)
                policy.insert(b, parent, req.timestamp_ms / 1000.0)
                held.add(b)
            parent = b
        if policy.switches != switches:  # a switch just happened: nothing was flushed
            switches = policy.switches
            assert len(policy) == len(held)
            assert {i for i, _ in policy.resident()} == held
    return held


def test_a_clear_lead_switches_the_leader_and_gets_its_hits() -> None:
    trace = _hot_and_scans(6000)
    capacity = 60
    own = {
        n: sum(replay_hits(trace, make_policy(n, capacity), capacity)) for n in ("lru", "s3fifo")
    }
    assert own["s3fifo"] > 1.5 * own["lru"]  # the workload separates them clearly
    policy = ElectPolicy(capacity, candidates=("lru", "s3fifo"))
    hits = [replay_request(policy, r, capacity) for r in trace]
    assert policy.leader == "s3fifo" and policy.switches >= 1
    # once switched it earns the winner's hits: the last half within 5% of S3-FIFO's own
    s3_last = replay_hits(trace, make_policy("s3fifo", capacity), capacity)[len(trace) // 2 :]
    assert sum(hits[len(trace) // 2 :]) >= 0.95 * sum(s3_last)


def test_candidates_that_tie_never_switch() -> None:
    """`prefix` and `prefix-run` differ only for new blocks deep in a run of misses; one-block
    requests have none, so the shadows tie on every request and the evidence never builds."""
    trace = _hot_and_scans(3000)
    policy = ElectPolicy(60, candidates=("prefix-run", "prefix"))
    replay_hits(trace, policy, 60)
    assert policy.switches == 0 and policy.leader == "prefix-run"


def test_a_switch_flushes_nothing() -> None:
    trace = _hot_and_scans(4000)
    policy = ElectPolicy(60, candidates=("lru", "s3fifo"))
    held = _tracked_replay(policy, trace, 60)
    assert policy.switches >= 1  # the checks inside ran at a switch
    assert len(held) == 60


def test_a_switch_of_a_large_tier_hands_over_nothing_and_the_old_leader_evicts_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A switch runs inside a put or a lookup, under the engine lock: where the tier holds
    more than `switch_adopt_max` items the new leader adopts none (O(1)); the old leader keeps
    them and they are evicted first, in its order, each one used again moving to the new
    leader. Nothing is flushed, the order a restart saves names the old leader's items first,
    and the winner's hits come as with a full handover."""
    from dpu_agent.eviction import S3FifoPolicy

    adopted: list[int] = []
    real_adopt = S3FifoPolicy.adopt

    def spy(self: S3FifoPolicy, items: Any, now: float) -> None:
        adopted.append(len(items))
        real_adopt(self, items, now)

    monkeypatch.setattr(S3FifoPolicy, "adopt", spy)
    trace, capacity = _hot_and_scans(6000), 60
    policy = ElectPolicy(capacity, candidates=("lru", "s3fifo"), switch_adopt_max=8)
    held: set[int] = set()
    draining: set[int] | None = None  # the old leader's items at the first switch, still held
    drained = 0  # evicted from the old leader
    for k, req in enumerate(trace):
        (b,) = req.hash_ids
        now = req.timestamp_ms / 1000.0
        if b in policy:
            policy.access(b, now)
            if draining is not None:
                draining.discard(b)  # used again: it joined the new leader
        else:
            if len(policy) >= capacity:
                victim = policy.victim(lambda _i: True)
                assert victim in held
                if draining:  # the old leader's items go first
                    assert victim in draining, k
                    draining.discard(victim)
                    drained += 1
                policy.remove(victim)
                held.discard(victim)
            policy.insert(b, None, now)
            held.add(b)
        if policy.switches and draining is None:  # the first switch happened in this call
            draining = set(held)  # b too: the old leader had it when the election ran
        assert len(policy) == len(held)
        if draining:  # what a restart would save: the old leader's items first
            order = policy.resident()
            assert {i for i, _ in order} == held
            assert {i for i, _ in order[: len(draining)]} == draining
            for limit in (1, 10, len(order)):
                assert policy.resident_later(limit)() == order[len(order) - limit :]
    assert policy.leader == "s3fifo" and adopted == []  # no switch adopted anything
    assert drained > 0 and draining == set(), (drained, draining)
    assert {i for i, _ in policy.resident()} == held
    full = ElectPolicy(capacity, candidates=("lru", "s3fifo"))
    hits_full = sum(replay_hits(trace, full, capacity)[len(trace) // 2 :])
    bounded = ElectPolicy(capacity, candidates=("lru", "s3fifo"), switch_adopt_max=8)
    hits_bounded = sum(replay_hits(trace, bounded, capacity)[len(trace) // 2 :])
    assert hits_bounded >= 0.95 * hits_full


def test_a_switch_keeps_the_prefix_tree() -> None:
    """Chains of five blocks (a hot set of eight chains, and scans of new chains), led first by
    LRU, which knows no parents: after the switch to `prefix` every victim is still a leaf, so
    the tree came across with the items."""
    rng = random.Random(3)
    capacity = 60
    policy = ElectPolicy(capacity, candidates=("lru", "prefix"))
    children: dict[int, int] = {}
    parent_of: dict[int, int | None] = {}
    fresh = 10_000
    for k in range(20_000):
        if k % 3 == 0:
            root = rng.randrange(8)
            chain = [root * 100 + d for d in range(5)]
        else:
            chain = [fresh + d for d in range(5)]
            fresh += 5
        parent: int | None = None
        for b in chain:
            if b in policy:
                policy.access(b, float(k))
            else:
                if len(policy) >= capacity:
                    v = policy.victim(partial(operator.ne, parent))
                    assert v is not None
                    if policy.switches:
                        assert children.get(v, 0) == 0, "a parent left before its children"
                    policy.remove(v)
                    up = parent_of.pop(v)
                    if up is not None:
                        children[up] -= 1
                held_parent = parent if parent is not None and parent in policy else None
                policy.insert(b, held_parent, float(k))
                parent_of[b] = held_parent
                if held_parent is not None:
                    children[held_parent] = children.get(held_parent, 0) + 1
            parent = b
        if policy.switches and k > 4000:
            break
    assert policy.leader == "prefix", "no switch: the hot chains did not separate them"


def test_shadows_hold_a_bounded_sample() -> None:
    """A tier of 40,000 items: each shadow holds at most SHADOW_ITEMS_MAX of them, whatever
    the tier's size, at the rate that keeps it there."""
    items = 40_000
    policy = ElectPolicy(items)
    rng = random.Random(1)
    item, now = 0, 0.0
    for step in range(5 * items):  # past youth: five turnovers
        if step % 8 == 0:
            now += 1.0
        if len(policy) >= items:
            v = policy.victim(lambda _: True)
            assert v is not None
            policy.remove(v)
        item += 1
        policy.insert(item, item - 1 if item - 1 in policy and rng.random() < 0.9 else None, now)
    assert policy.shadow_items() <= 3 * SHADOW_ITEMS_MAX
    assert policy.sample_rate <= SHADOW_ITEMS_MAX / items
    assert policy.shadow_items() >= 3 * SHADOW_ITEMS_MAX // 4  # and the shadows are not empty


def test_the_sampling_rate_bounds_the_shadows_work() -> None:
    """The shadows see about `sample_rate` of the references: a grown cache of 1,000 items
    samples 1/8 (the steady rate), and the sampled references are about an eighth."""
    capacity = 1000
    policy = ElectPolicy(capacity)
    rng = random.Random(2)
    for k in range(20_000):
        b = rng.randrange(3000)
        replay_request(policy, Request(timestamp_ms=float(k), hash_ids=(b,)), capacity)
    assert policy.sample_rate == 0.125
    before = policy.sampled_references
    for k in range(20_000, 40_000):
        b = rng.randrange(3000)
        replay_request(policy, Request(timestamp_ms=float(k), hash_ids=(b,)), capacity)
    share = (policy.sampled_references - before) / 20_000
    assert 0.07 <= share <= 0.2, share


def test_a_small_cache_samples_everything() -> None:
    """Below SHADOW_ITEMS_MIN items per shadow at the steady rate, the rate stays 1."""
    capacity = 2 * SHADOW_ITEMS_MIN  # at 1/4 or 1/8 a shadow would hold too few
    policy = ElectPolicy(capacity)
    for k in range(20 * capacity):
        replay_request(policy, Request(timestamp_ms=float(k), hash_ids=(k % 500,)), capacity)
    assert policy.sample_rate >= 0.5


def test_the_sample_follows_the_item_across_eviction_and_return() -> None:
    """Whether a chunk is sampled depends on its item (the engine's hash of its key) only:
    evicted and put again it is the same sample member, so its shadow history counts."""
    policy = ElectPolicy(50)
    for i in range(50):
        policy.insert(i, None, float(i))
    sampled = {i: policy.sampled(i) for i in range(50)}
    for i in range(50):
        policy.remove(i)
    for i in reversed(range(50)):
        policy.insert(i, None, 100.0 + i)
        assert policy.sampled(i) == sampled[i]


def test_the_engine_gives_elects_simulated_hits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real Engine, elect switches leader and adopts the tier as in the simulator:
    the same hits. (LRU and S3-FIFO as candidates: this short trace separates them.)"""
    two = partial(ElectPolicy, candidates=("lru", "s3fifo"))
    monkeypatch.setitem(_registry._FACTORIES, "elect", two)
    trace = _hot_and_scans(2500)
    got = replay_engine(trace, "elect", 60, data_dir=tmp_path)
    policy = two(60)
    assert got.hits == sum(replay_hits(trace, policy, 60))
    assert policy.switches >= 1 and policy.leader == "s3fifo"


def test_parent_links_that_loop_do_not_hang_a_switch() -> None:
    """A client puts A under B, B leaves, then B comes back under A: the parent links loop.
    Finding a sampled ancestor and handing the tier to a new leader both still end."""
    policy = ElectPolicy(8, shadow_items_max=1, shadow_items_min=1)
    for i in range(100, 104):  # four items held: at most one per shadow, so R <= 1/4
        policy.insert(i, None, 0.0)
    assert policy.sample_rate <= 0.25
    a = next(i for i in range(1000, 2000) if not policy.sampled(i))
    b = next(i for i in range(2000, 3000) if not policy.sampled(i))
    policy.insert(a, None, 1.0)
    policy.insert(b, a, 1.0)
    policy.remove(a)
    policy.insert(a, b, 2.0)  # a under b, and b still under a
    sampled = [i for i in range(3000, 4000) if policy.sampled(i)][:3]
    for k, item in enumerate(sampled):  # each walks the loop looking for a sampled ancestor
        policy.insert(item, a, 3.0 + k)
        policy.remove(item)
    assert len(policy) == 6
    fresh = make_policy("prefix", 8)
    fresh.adopt([(b, a, False), (a, b, False)], 10.0)
    assert len(fresh) == 2 and a in fresh and b in fresh


def test_lru2_hands_its_tier_over_and_takes_one_in_order() -> None:
    """`resident()` lists LRU-2's items in the order it evicts them; a new LRU-2 that adopts
    them evicts in that order (used ones after every one used once), and the first real use
    after the handover counts as a second reference."""
    lru2 = make_policy("lru2", 100)
    for i in range(10):
        lru2.insert(i, None, float(i))
    for i in (7, 2, 5):
        lru2.access(i, 20.0 + i)
    handed = lru2.resident()
    assert [u for _, u in handed] == [False] * 7 + [True] * 3
    order = []
    while (v := lru2.victim(lambda _: True)) is not None:
        order.append(v)
        lru2.remove(v)
    assert order == [i for i, _ in handed] == [0, 1, 3, 4, 6, 8, 9, 2, 5, 7]
    new = make_policy("lru2", 100)
    new.adopt([(i, None, u) for i, u in handed], 100.0)
    assert new.resident() == handed
    new.access(0, 100.1)  # within a second of the adoption, yet a second reference
    assert new.victim(lambda _: True) == 1
    from_lru = make_policy("lru", 100)
    for i in range(5):
        from_lru.insert(i, None, float(i))
    from_lru.access(1, 9.0)
    taken = make_policy("lru2", 100)
    taken.adopt([(i, None, u) for i, u in from_lru.resident()], 10.0)
    assert [i for i, _ in taken.resident()] == [0, 2, 3, 4, 1]


def test_a_clear_lead_of_lru2_switches_to_it_without_a_flush() -> None:
    trace = _hot_and_scans_slow(6000)
    capacity = 50
    own = {n: sum(replay_hits(trace, make_policy(n, capacity), capacity)) for n in ("lru", "lru2")}
    assert own["lru2"] > 2 * own["lru"]  # the workload separates them clearly
    policy = ElectPolicy(capacity, candidates=("lru", "lru2"))
    held = _tracked_replay(policy, trace, capacity)
    assert policy.leader == "lru2" and policy.switches >= 1
    assert len(held) == capacity


def test_a_restart_begins_with_the_leader_the_tier_had() -> None:
    """`state()` names the leader; a new instance given it (`restore`) leads with that
    candidate from its first call, and one holding items hands them over as at a switch
    (nothing flushed). An unknown or malformed state changes nothing."""
    two = partial(ElectPolicy, candidates=("lru", "s3fifo"))
    first = two(60)
    replay_hits(_hot_and_scans(2500), first, 60)
    assert first.leader == "s3fifo" and first.state() == {"leader": "s3fifo"}
    fresh = two(60)
    fresh.restore(first.state(), 0.0)
    assert fresh.leader == "s3fifo" and fresh.switches == 0
    held = two(10)
    for i in range(10):
        held.insert(i, i - 1 if i else None, float(i))
    held.restore({"leader": "s3fifo"}, 20.0)
    assert held.leader == "s3fifo" and len(held) == 10
    assert sorted(i for i, _ in held.resident()) == list(range(10))
    for bad in ({}, {"leader": "belady"}, {"leader": 3}, {"leader": ["lru"]}):
        other = two(60)
        other.restore(bad, 0.0)
        assert other.leader == "lru"


def test_the_engine_replay_carries_the_leader_across_a_restart_as_the_simulator_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace whose cache restarts empty halfway, through the real Engine and through its fast
    path: the same hits, and the second half begins with the first half's leader (the engine
    hands it over as `policy_state`, what it writes beside its checkpoint)."""
    from dpu_agent.bench.replay_engine import policy_hits

    two = partial(ElectPolicy, candidates=("lru", "s3fifo"))
    monkeypatch.setitem(_registry._FACTORIES, "elect", two)
    trace = _hot_and_scans(2500)
    parts = [trace, trace[:400]]
    engine, _ = policy_hits(parts, "elect", 60, engine=True, data_dir=tmp_path)
    fast, _ = policy_hits(parts, "elect", 60, engine=False)
    assert engine == fast
    first = replay_engine(trace, "elect", 60, data_dir=tmp_path)
    assert first.policy_state["replay"]["nvme"] == {"leader": "s3fifo"}
    carried = two(60)
    carried.restore({"leader": "s3fifo"}, 0.0)
    assert fast[len(trace) :] == replay_hits(trace[:400], carried, 60)
    assert fast[len(trace) :] != replay_hits(trace[:400], two(60), 60)  # the prior differs


def test_a_tier_taken_over_at_a_restart_scores_nothing() -> None:
    """`adopt` (a clean restart's saved order): the leader takes the items in that order; the
    shadows and the evidence start empty and no request is scored, so adoption alone never
    moves the election; the tier goes on as any."""
    first = ElectPolicy(60)
    replay_hits(_hot_and_scans(2500), first, 60)
    saved = first.resident()
    parents = dict.fromkeys((i for i, _ in saved), None)
    fresh = ElectPolicy(60)
    fresh.adopt([(i, parents[i], used) for i, used in saved], 100.0)
    assert len(fresh) == len(first) and fresh.switches == 0
    assert fresh.sampled_references == 0  # nothing scored
    assert [i for i, _ in fresh.resident()] == [i for i, _ in saved]
    assert fresh.shadow_items() == 0
    assert fresh.victim(lambda item: True) == first.victim(lambda item: True)
    assert sum(replay_hits(_hot_and_scans(600, seed=9), fresh, 60)) > 0
    assert len(fresh) <= 60 and fresh.sampled_references > 0


def test_a_takeover_keeps_the_parent_links_for_a_later_switch() -> None:
    """Items come children first (the order they go in); each keeps its held parent, so a
    switch after the takeover hands the new leader the prefix tree, not loose leaves."""
    chain = [(i, i - 1 if i else None, False) for i in reversed(range(20))]
    fresh = ElectPolicy(40)
    fresh.adopt(chain, 5.0)
    assert fresh._parent == {i: (i - 1 if i else None) for i in range(20)}
