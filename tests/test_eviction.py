"""Eviction policies: the shared contract, and each policy's semantics on hand-made sequences."""

from __future__ import annotations

import itertools
import random
import tracemalloc
from collections.abc import Callable

import pytest

from dpu_agent.bench.replay import Request, generate_trace, replay_hits
from dpu_agent.eviction import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ClockPolicy,
    EvictionPolicy,
    Lru2Policy,
    PrefixPolicy,
    RunAwarePrefixPolicy,
    S3FifoPolicy,
    make_policy,
)


def always(_: int) -> bool:
    return True


def outside(pinned: set[int]) -> Callable[[int], bool]:
    return lambda item: item not in pinned


def filled(name: str, items: list[int], capacity: int = 100) -> EvictionPolicy:
    policy = make_policy(name, capacity)
    for i, item in enumerate(items):
        policy.insert(item, None, float(i))
    return policy


def test_make_policy_names_and_default() -> None:
    assert set(POLICY_NAMES) >= {"lru", "lru2", "clock", "s3fifo", "arc", "prefix", "prefix-run"}
    assert DEFAULT_POLICY == "elect"
    for name in POLICY_NAMES:
        assert make_policy(name, 10).name == name


def test_make_policy_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"lru2.*s3fifo.*prefix"):
        make_policy("mru", 10)
    with pytest.raises(ValueError, match="got 0"):
        make_policy("lru", 0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_contract_len_contains_remove(name: str) -> None:
    policy = filled(name, [1, 2, 3])
    assert len(policy) == 3 and 2 in policy and 4 not in policy
    policy.remove(2)
    assert len(policy) == 2 and 2 not in policy
    for _ in range(5):
        assert policy.victim(always) in {1, 3}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_victim_honours_evictable(name: str) -> None:
    policy = filled(name, list(range(20)))
    for i in range(0, 20, 3):
        policy.access(i, 50.0)
    assert policy.victim(lambda item: item == 7) == 7
    assert policy.victim(lambda item: False) is None
    assert make_policy(name, 10).victim(always) is None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_random_operations_keep_the_contract(name: str) -> None:
    """Model check: victims are always cached and evictable; None only if nothing is."""
    rng = random.Random(name)
    capacity = 32
    policy, cached = make_policy(name, capacity), set[int]()
    pinned: set[int] = set()
    for step in range(3000):
        item = rng.randrange(80)
        now = step / 10
        if item in cached:
            policy.access(item, now)
        else:
            if len(cached) >= capacity:
                victim = policy.victim(outside(pinned))
                if victim is None:
                    assert cached <= pinned
                    continue
                assert victim in cached and victim not in pinned
                policy.remove(victim)
                cached.discard(victim)
            parent = rng.choice(sorted(cached)) if cached and rng.random() < 0.5 else None
            policy.insert(item, parent, now)
            cached.add(item)
        if rng.random() < 0.02:
            pinned = set(rng.sample(sorted(cached), k=min(len(cached), 8)))
        assert len(policy) == len(cached)
        assert all(i in policy for i in cached)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_order_taken_now_and_computed_later_is_the_order_of_now(name: str) -> None:
    """`resident_later()` copies under the caller's lock and orders after: with nothing
    touched between, the order is `resident()`'s (with a limit, its last `limit`: the hottest,
    all a restart hands back); with items evicted, put and used between, it
    still names exactly the items held when it was taken, each once. Random operations on a
    prefix tree, as the tier makes them."""
    rng = random.Random(f"later-{name}")
    policy, cached = make_policy(name, 48), set[int]()
    try:
        policy.resident()
    except NotImplementedError:
        pytest.skip(f"{name} cannot hand a tier over")
    for step in range(2000):
        item = rng.randrange(120)
        now = step // 3 / 10  # three blocks share a request's time
        if item in cached:
            policy.access(item, now)
            continue
        if len(cached) >= 48:
            victim = policy.victim(always)
            assert victim is not None
            policy.remove(victim)
            cached.discard(victim)
        parent = rng.choice(sorted(cached)) if cached and rng.random() < 0.7 else None
        policy.insert(item, parent, now)
        cached.add(item)
        if step % 500 == 499:
            now_order = policy.resident()
            assert policy.resident_later()() == now_order
            for limit in (0, 1, 7, len(now_order), len(now_order) + 5):  # the hottest `limit`
                hottest = now_order[max(0, len(now_order) - limit) :]
                assert policy.resident_later(limit)() == hottest, limit
            later, held = policy.resident_later(), set(cached)
            for j in range(200, 230):  # puts that evict, and uses of what is held
                if rng.random() < 0.5 and cached:
                    policy.access(rng.choice(sorted(cached)), now + 1)
                victim = policy.victim(always)
                assert victim is not None
                policy.remove(victim)
                cached.discard(victim)
                policy.insert(j + step, None, now + 1)
                cached.add(j + step)
            order = later()
            assert len(order) == len(held) and {i for i, _ in order} == held


@pytest.mark.parametrize("name", ["prefix", "prefix-run"])
def test_a_prefix_adoption_building_its_heaps_once_evicts_as_one_pushing_each(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PrefixPolicy.adopt` builds its heaps once at the end instead of pushing per insert and
    use: the same items in the same order, every victim after the same as the plain
    `EvictionPolicy.adopt`'s, with puts, uses and pinned items after the handover."""
    rng = random.Random(f"adopt-{name}")
    items: list[tuple[int, int | None, bool]] = []
    for i in range(400):  # chains, and loose ids; parents sometimes after their children
        parent = items[rng.randrange(len(items))][0] if items and rng.random() < 0.6 else None
        items.append((1000 + i, parent, rng.random() < 0.4))
    rng.shuffle(items)
    fast, plain = make_policy(name, 300), make_policy(name, 300)
    fast.adopt(items, 50.0)
    with monkeypatch.context() as m:  # `prefix-run`'s own adopt, over the plain one
        m.setattr(PrefixPolicy, "adopt", EvictionPolicy.adopt)
        plain.adopt(items, 50.0)
    assert fast.resident() == plain.resident()
    pinned = {i for i, _, _ in items[:20]}
    for step in range(600):
        now = 51.0 + step // 4
        if rng.random() < 0.3:
            held = [i for i, _ in plain.resident()]
            item = held[rng.randrange(len(held))]
            fast.access(item, now)
            plain.access(item, now)
            continue
        victim = fast.victim(outside(pinned))
        assert victim == plain.victim(outside(pinned)), step
        if victim is not None:
            fast.remove(victim)
            plain.remove(victim)
        fast.insert(5000 + step, None, now)
        plain.insert(5000 + step, None, now)
    assert fast.resident() == plain.resident()


def test_lru_evicts_least_recently_used() -> None:
    policy = filled("lru", [1, 2, 3])
    policy.access(1, 10.0)
    assert policy.victim(always) == 2
    policy.remove(2)
    assert policy.victim(always) == 3


def test_lru2_prefers_items_referenced_once() -> None:
    policy = Lru2Policy(10, correlated_period_s=1.0)
    for t, item in enumerate([1, 2, 3]):
        policy.insert(item, None, t * 10.0)
    policy.access(1, 30.0)
    policy.access(2, 40.0)
    assert policy.victim(always) == 3  # newest, but referenced only once
    policy.remove(3)
    assert policy.victim(always) == 1  # oldest second-to-last reference (0 < 10)


def test_lru2_correlated_reference_does_not_count() -> None:
    policy = Lru2Policy(10, correlated_period_s=1.0)
    policy.insert(1, None, 0.0)
    policy.access(1, 5.0)  # two uncorrelated references
    policy.insert(2, None, 100.0)
    policy.access(2, 100.5)  # within the correlated period: still one reference
    assert policy.victim(always) == 2


def test_lru2_remembers_evicted_items() -> None:
    policy = Lru2Policy(10, correlated_period_s=0.0)
    policy.insert(1, None, 0.0)
    policy.remove(1)  # evicted; its reference stays in the history
    policy.insert(2, None, 10.0)
    policy.insert(1, None, 20.0)  # second reference
    assert policy.victim(always) == 2


def test_clock_scores_decay_with_time() -> None:
    def victim_after_quiet(half_life_s: float) -> int | None:
        policy = ClockPolicy(10, half_life_s=half_life_s)
        policy.insert(1, None, 0.0)
        for _ in range(4):
            policy.access(1, 0.0)  # popular long ago
        policy.insert(2, None, 0.0)
        policy.access(2, 100.0)  # used once, just now
        return policy.victim(always)

    assert victim_after_quiet(half_life_s=1e9) == 2  # no decay: frequency wins
    assert victim_after_quiet(half_life_s=10.0) == 1  # ten half-lives later: recency wins


def test_clock_gives_accessed_items_a_second_chance() -> None:
    policy = filled("clock", [1, 2, 3])
    policy.access(1, 3.0)
    assert policy.victim(always) == 2


def test_s3fifo_one_hit_wonders_leave_from_small_queue() -> None:
    policy = S3FifoPolicy(10)
    for item in range(1, 11):
        policy.insert(item, None, 0.0)
    assert policy.victim(always) == 1


def test_s3fifo_promotes_on_reaccess() -> None:
    policy = S3FifoPolicy(10)
    for item in range(1, 11):
        policy.insert(item, None, 0.0)
    policy.access(1, 1.0)
    assert policy.victim(always) == 2  # 1 moved to the main queue instead
    policy.remove(2)
    assert policy.victim(always) == 3


def test_s3fifo_ghost_hit_enters_main_queue() -> None:
    policy = S3FifoPolicy(10)
    for item in range(1, 11):
        policy.insert(item, None, 0.0)
    policy.remove(policy.victim(always) or 0)  # 1 goes to the ghost queue
    policy.insert(1, None, 1.0)  # comes back: straight to main
    for _ in range(8):
        victim = policy.victim(always)
        assert victim != 1
        policy.remove(victim or 0)


def test_arc_evicts_recency_list_first() -> None:
    policy = filled("arc", [1, 2, 3, 4])
    policy.access(1, 5.0)
    policy.access(2, 5.0)
    assert policy.victim(always) == 3


def chain(policy: EvictionPolicy, items: list[int], now: float) -> None:
    parent = None
    for item in items:
        policy.insert(item, parent, now)
        parent = item


def test_prefix_evicts_children_before_parents() -> None:
    policy = PrefixPolicy(100)
    chain(policy, [1, 2, 3], 0.0)
    for _ in range(3):
        policy.access(1, 1.0)  # a hot root
    order = []
    while len(policy):
        victim = policy.victim(always)
        assert victim is not None
        order.append(victim)
        policy.remove(victim)
    assert order == [3, 2, 1]


def test_prefix_keeps_parent_of_pinned_child_while_other_leaves_exist() -> None:
    policy = PrefixPolicy(100)
    chain(policy, [1, 2, 3], 0.0)
    chain(policy, [10, 11], 5.0)  # newer chain
    assert policy.victim(lambda i: i != 3) == 11  # 2 and 1 still have a cached child
    # Nothing else evictable: a parent must go; the deeper one orphans fewer chunks.
    assert policy.victim(lambda i: i in {1, 2}) == 2


@pytest.mark.parametrize("name", ["prefix", "prefix-run"])
def test_prefix_never_evicts_parent_with_evictable_child_random(name: str) -> None:
    rng = random.Random(7)
    policy, parents = make_policy(name, 64), dict[int, int | None]()
    for step in range(2000):
        item = step
        parent = rng.choice(sorted(parents)) if parents and rng.random() < 0.7 else None
        if len(policy) >= 64:
            pinned = set(rng.sample(sorted(parents), k=4))
            victim = policy.victim(outside(pinned))
            assert victim is not None
            children = [c for c, p in parents.items() if p == victim]
            if children:  # allowed only when no evictable leaf exists
                has_child = {p for p in parents.values() if p is not None}
                assert not [i for i in parents if i not in has_child and i not in pinned]
            policy.remove(victim)
            del parents[victim]
            if parent == victim:
                parent = None
        policy.insert(item, parent, float(step))
        parents[item] = parent
        if rng.random() < 0.3:
            policy.access(rng.choice(sorted(parents)), float(step))


def test_prefix_new_items_go_before_reused_ones() -> None:
    policy = PrefixPolicy(4)  # probation's initial share: 0.4 items, so 1 is over it
    policy.insert(1, None, 0.0)
    policy.access(1, 1.0)  # reused: protected
    policy.insert(2, None, 2.0)  # seen once: probation
    assert policy.victim(always) == 2


def test_prefix_probation_share_adapts_to_ghost_hits() -> None:
    """A returning id that was evicted from probation wins probation more room (ARC)."""
    policy = PrefixPolicy(4)
    policy.insert(1, None, 0.0)
    policy.access(1, 1.0)
    policy.insert(2, None, 2.0)
    policy.remove(2)  # evicted from probation: ghost B1
    policy.insert(2, None, 3.0)  # B1 hit: the target grows and 2 returns protected
    policy.insert(3, None, 4.0)  # probation holds 1 item, now within its share
    assert policy.victim(always) == 1  # the least recently used protected leaf


def test_prefix_parent_outside_the_tier() -> None:
    """The engine passes parents that live in another tier, or come and go (demotion)."""
    policy = PrefixPolicy(100)
    policy.insert(2, 1, 0.0)  # parent 1 is not in this tier
    policy.insert(1, None, 1.0)  # now it is, but 2 was not counted as its child
    assert policy.victim(always) == 2  # older leaf
    policy.remove(2)
    policy.remove(1)
    assert len(policy) == 0


def test_prefix_parent_evicted_and_back_before_its_child() -> None:
    policy = PrefixPolicy(100)
    chain(policy, [1, 2], 0.0)
    assert policy.victim(lambda i: i == 1) == 1  # child pinned: the parent must go
    policy.remove(1)
    policy.insert(1, None, 5.0)  # the parent comes back (re-fetched)
    policy.remove(2)  # the child's count belonged to the old parent node
    assert policy.victim(always) == 1
    policy.remove(1)
    assert policy.victim(always) is None


def hits_with_hint(policy: EvictionPolicy, capacity: int, trace: list[tuple[int, ...]]) -> int:
    """Replay with the caller evicting at `capacity`, whatever the policy was told."""
    hits = 0
    for now, ids in enumerate(trace):
        for b in ids:
            if b not in policy:
                break
            hits += 1
        parent = None
        for b in ids:
            if b in policy:
                policy.access(b, float(now))
            else:
                if len(policy) >= capacity:
                    victim = policy.victim(outside(set(ids)))
                    assert victim is not None
                    policy.remove(victim)
                policy.insert(b, parent, float(now))
            parent = b
    return hits


@pytest.mark.parametrize("name", ["prefix", "prefix-run"])
def test_prefix_split_does_not_depend_on_the_capacity_hint(name: str) -> None:
    """Tiers pass their block count (several blocks per chunk): the learnt split must hold."""
    trace = [r.hash_ids for r in generate_trace("docs", 600, seed=1)]
    exact = hits_with_hint(make_policy(name, 300), 300, trace)
    assert exact > 0
    assert hits_with_hint(make_policy(name, 300 * 64), 300, trace) == exact


# --- prefix-run: new blocks deep in a run of misses are predicted to return late ---------------


def test_prefix_run_deep_new_blocks_go_before_an_older_conversation_tail() -> None:
    policy = RunAwarePrefixPolicy(100)
    chain(policy, [1, 2], 0.0)  # the newest turn of a conversation: a short run
    chain(policy, list(range(10, 22)), 1.0)  # then a one-off document: a run of 12 new blocks
    assert policy.victim(always) == 21  # newer, but deep in a long run
    plain = PrefixPolicy(100)
    chain(plain, [1, 2], 0.0)
    chain(plain, list(range(10, 22)), 1.0)
    assert plain.victim(always) == 2  # `prefix` goes by recency alone


def test_prefix_run_short_runs_and_their_first_blocks_keep_recency() -> None:
    policy = RunAwarePrefixPolicy(100)
    chain(policy, [1, 2], 0.0)
    chain(policy, [10, 11, 12, 13], 1.0)  # a run of 4: not penalised
    assert policy.victim(always) == 2
    policy.remove(2)
    policy.remove(1)
    chain(policy, list(range(20, 30)), 2.0)  # blocks 20-23 start the run, 24-29 are deep in it
    order = []
    for _ in range(8):
        victim = policy.victim(always)
        assert victim is not None
        order.append(victim)
        policy.remove(victim)
    assert order == [29, 28, 27, 26, 25, 24, 13, 12]  # deep tail first, then plain recency


def test_prefix_run_blocks_seen_before_are_not_new() -> None:
    """The sketch remembers ids after the ghost lists have dropped them."""
    policy = RunAwarePrefixPolicy(100)
    doc = list(range(10, 22))
    chain(policy, doc, 0.0)
    for item in reversed(doc):
        policy.remove(item)
    chain(policy, [1], 1.0)  # trims the ghost lists to the one item held: the ids are gone
    chain(policy, doc, 2.0)  # the document again: a run of misses, but not new
    assert policy.victim(always) == 1


def test_prefix_run_a_hit_makes_a_penalised_block_ordinary() -> None:
    policy = RunAwarePrefixPolicy(100)
    chain(policy, [1, 2], 0.0)
    chain(policy, list(range(10, 16)), 1.0)  # 14 and 15 are deep in the run
    for item in range(10, 16):
        policy.access(item, 2.0)  # the document is read again: protected, fresh
    assert policy.victim(always) == 2


def _conversations(rounds: int = 300, first: int = 12, gap: int = 5) -> list[Request]:
    """Each round opens a conversation with a long new first turn (deep in a run: penalised)
    and continues the one opened `gap` rounds before (its first turn plus two new blocks)."""
    ids = itertools.count(1)
    opened: dict[int, list[int]] = {}
    out = []
    for r in range(rounds):
        opened[r] = [next(ids) for _ in range(first)]
        out.append(Request(float(2 * r), tuple(opened[r])))
        if r - gap in opened:
            turn = [*opened.pop(r - gap), next(ids), next(ids)]
            out.append(Request(float(2 * r + 1), tuple(turn)))
    return out


def _one_off_documents(rounds: int = 300, doc: int = 12, prompts: int = 6) -> list[Request]:
    """Each round a one-off document (never read again) and a question behind one of a few
    short system prompts, which come back every `prompts` rounds."""
    ids = itertools.count(1_000_000)
    systems = [[next(ids) for _ in range(3)] for _ in range(prompts)]
    out = []
    for r in range(rounds):
        out.append(Request(float(2 * r), tuple(next(ids) for _ in range(doc))))
        out.append(Request(float(2 * r + 1), (*systems[r % prompts], next(ids))))
    return out


def test_prefix_run_learns_to_drop_its_penalty_when_penalised_blocks_come_back() -> None:
    """First turns that come back within what the cache can hold: the penalty's weight falls
    (ARC's rule on its own ghost list) and the cache keeps them, as `prefix` does."""
    trace = _conversations()
    policy = RunAwarePrefixPolicy(200)
    assert policy.penalty_weight == 1.0  # a cold tier starts with the whole penalty
    hits = sum(replay_hits(trace, policy, 200))
    plain = sum(replay_hits(trace, PrefixPolicy(200), 200))
    assert policy.penalty_weight < 0.5
    assert hits >= 0.95 * plain > 0  # with the whole penalty throughout: 1,605 of 3,479


def test_prefix_run_keeps_its_penalty_when_penalised_blocks_never_come_back() -> None:
    trace = _one_off_documents()
    policy = RunAwarePrefixPolicy(60)
    hits = sum(replay_hits(trace, policy, 60))
    plain = sum(replay_hits(trace, PrefixPolicy(60), 60))
    assert policy.penalty_weight == 1.0
    assert hits > 1.5 * plain  # the one-offs leave first; `prefix` loses the prompts to them


def test_prefix_run_memory_of_penalised_blocks_is_bounded() -> None:
    """The penalised blocks' ghost list holds at most the items held: a stream of one-off
    documents does not grow the policy."""
    trace = _one_off_documents(rounds=4000)
    policy = RunAwarePrefixPolicy(60)
    tracemalloc.start()
    try:
        replay_hits(trace[:1000], policy, 60)
        before = tracemalloc.get_traced_memory()[0]
        replay_hits(trace[1000:], policy, 60)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, grown  # unbounded: ~30,000 ids more


def test_prefix_run_honours_evictable_and_remove() -> None:
    policy = RunAwarePrefixPolicy(100)
    chain(policy, [1, 2], 0.0)
    chain(policy, list(range(10, 20)), 1.0)
    assert policy.victim(lambda i: i != 19) == 2  # the penalised leaf is pinned: next leaf
    policy.remove(19)  # the tier evicted it anyway (demotion): its parent is now a leaf
    assert policy.victim(always) == 18
    assert policy.victim(lambda i: i in {10, 11}) == 11  # no leaf evictable: deepest parent
    assert 19 not in policy and len(policy) == 11


def test_prefix_keeps_a_quarter_of_a_young_cache_for_new_blocks() -> None:
    """Probation starts at a quarter of the items held (PROBATION_START): a cache that has
    turned over only a few times (ARC's step has barely moved the split) keeps the newest
    blocks, a conversation's latest turn, over older reused ones. With S3-FIFO's 10%, 2 new
    blocks of 8 were already over probation's share and went first: `prefix` fell under LRU
    on large caches of conversations (docs/EVICTION.md, "Probation's starting share")."""
    policy = PrefixPolicy(8)
    for item in range(6):
        policy.insert(item, None, float(item))
        policy.access(item, float(item) + 0.5)  # reused: protected
    policy.insert(6, None, 10.0)  # the newest turn: probation
    policy.insert(7, None, 11.0)
    assert policy.victim(always) == 0  # the least recently used protected leaf
    policy.insert(8, None, 12.0)  # 3 of 9 now: over a quarter, the oldest new block goes
    assert policy.victim(always) == 6
    # `prefix-run` keeps S3-FIFO's 10% (its penalty already clears deep runs from probation)
    run = RunAwarePrefixPolicy(8)
    for item in range(6):
        run.insert(item, None, float(item))
        run.access(item, float(item) + 0.5)
    run.insert(6, None, 10.0)
    run.insert(7, None, 11.0)
    assert run.victim(always) == 6
