"""The trace-replay benchmark: the prefix hit rule, Belady, the generator and the CLI."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.bench.replay import (
    SYNTHETIC_SHAPES,
    Request,
    generate_trace,
    load_trace,
    replay,
    replay_belady,
    replay_command,
    replay_hits,
    replay_policy,
    write_trace,
)
from dpu_agent.eviction import DEFAULT_POLICY, POLICY_NAMES, make_policy


def trace_of(*requests: list[int]) -> list[Request]:
    return [Request(float(i * 1000), tuple(ids)) for i, ids in enumerate(requests)]


def test_belady_hand_checked_counts() -> None:
    # Roots only: 1 2 1 3 1 2. Capacity 1: keep 1 (bypass 2 and 3) -> hits at 1, 1.
    trace = trace_of([1], [2], [1], [3], [1], [2])
    assert replay_belady(trace, 1) == 2
    assert replay_policy(trace, "lru", 1) == 0
    # Capacity 2: keep 1 and 2, bypass 3 -> hits at 1, 1, 2; LRU evicts 2 for 3.
    assert replay_belady(trace, 2) == 3
    assert replay_policy(trace, "lru", 2) == 2


def test_belady_keeps_the_prefix_not_the_tail() -> None:
    # Chain 1-2-3 then 1-2 reused twice: with room for 2, keep 1 and 2 (4 hits).
    trace = trace_of([1, 2, 3], [1, 2], [1, 2])
    assert replay_belady(trace, 2) == 4


def test_prefix_rule_a_cached_block_after_a_miss_is_not_a_hit() -> None:
    # LRU with room for 3: [4] evicts 1, so [1, 2, 3] misses at 1 and 2, 3 do not count.
    trace = trace_of([1, 2, 3], [4], [1, 2, 3])
    assert replay_policy(trace, "lru", 3) == 0
    assert replay_policy(trace, "lru", 4) == 3


def test_request_longer_than_cache_keeps_its_tail_as_the_engine_does() -> None:
    """Only the block a put extends is kept (the engine's rule), so a request longer than the
    cache evicts its own older blocks and ends holding its tail: the next identical request
    misses at its first block. (Belady may bypass, and keeps the head.)"""
    trace = trace_of([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    for name in POLICY_NAMES:
        policy = make_policy(name, 2)
        assert replay_hits(trace, policy, 2) == [0, 0], name
        assert 5 in policy and 4 in policy, name
    assert replay_belady(trace, 2) == 2


@pytest.mark.parametrize("shape", SYNTHETIC_SHAPES)
def test_belady_bounds_every_policy(shape: str) -> None:
    trace = generate_trace(shape, 300, seed=3)
    distinct = len({b for r in trace for b in r.hash_ids})
    for capacity in (distinct // 50, distinct // 10):
        opt = replay_belady(trace, capacity)
        for name in POLICY_NAMES:
            assert replay_policy(trace, name, capacity) <= opt, (shape, capacity, name)


def test_generator_is_seeded_and_tree_consistent() -> None:
    for shape in SYNTHETIC_SHAPES:
        a, b = generate_trace(shape, 200, seed=1), generate_trace(shape, 200, seed=1)
        assert a == b
        assert a != generate_trace(shape, 200, seed=2)
        parent: dict[int, int | None] = {}
        for r in a:
            for prev, block in zip((None, *r.hash_ids), r.hash_ids, strict=False):
                assert parent.setdefault(block, prev) == prev
        assert all(x.timestamp_ms <= y.timestamp_ms for x, y in itertools.pairwise(a))
    with pytest.raises(ValueError, match="chat"):
        generate_trace("nope", 10)


def test_load_trace_round_trip_and_errors(tmp_path: Path) -> None:
    trace = generate_trace("docs", 50, seed=1)
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert load_trace(path) == trace
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=":2: not a trace record"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "hash_ids": [1, 1]}\n')
    with pytest.raises(ValueError, match="distinct"):
        load_trace(path)


def test_replay_report_gap_closed() -> None:
    rows = replay(generate_trace("chat", 300, seed=1), [0.05], "prefix", ["lru"])
    (row,) = rows
    assert row["opt_is_upper_bound"]
    assert row["lru_hit_rate"] <= row["opt_hit_rate"]
    want = (row["hit_rate"] - row["lru_hit_rate"]) / (row["opt_hit_rate"] - row["lru_hit_rate"])
    assert row["gap_closed"] == pytest.approx(want)
    with pytest.raises(ValueError, match="fraction"):
        replay(generate_trace("chat", 10), [1.5])


def test_cli_prints_json_report(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate_trace("chat", 300, seed=1))
    plot = tmp_path / "replay.png"
    args = ["--trace", str(path), "--capacity-fraction", "0.02", "--capacity-fraction", "0.1"]
    result = CliRunner().invoke(
        replay_command, [*args, "--simulator", "--json", "--plot", str(plot)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["trace"] == str(path) and report["policy"] == DEFAULT_POLICY
    assert [r["capacity_fraction"] for r in report["results"]] == [0.02, 0.1]
    for row in report["results"]:
        for key in ("capacity_blocks", "hit_rate", "lru_hit_rate", "opt_hit_rate", "gap_closed"):
            assert key in row, key
        assert set(row["policies"]) == set(POLICY_NAMES)
        assert all(0.0 <= v <= row["opt_hit_rate"] for v in row["policies"].values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_replays_through_the_engine_by_default(tmp_path: Path) -> None:
    args = ["--synthetic", "docs", "--requests", "100", "--capacity-fraction", "0.05"]
    engine = CliRunner().invoke(replay_command, [*args, "--data-dir", str(tmp_path), "--json"])
    assert engine.exit_code == 0, engine.output
    fast = CliRunner().invoke(replay_command, [*args, "--simulator", "--json"])
    (row,) = json.loads(engine.output)["results"]
    (fast_row,) = json.loads(fast.output)["results"]
    assert row["replayed_through"] == "engine" and fast_row["replayed_through"] == "simulator"
    assert row["policies"] == fast_row["policies"]
    hits = row["hit_rate"] * sum(len(r.hash_ids) for r in generate_trace("docs", 100))
    assert sum(row["hits_by_tier"][DEFAULT_POLICY].values()) == round(hits)


def test_cli_synthetic_table() -> None:
    args = ["--synthetic", "docs", "--requests", "200", "--capacity-fraction", "0.05"]
    result = CliRunner().invoke(replay_command, args)
    assert result.exit_code == 0, result.output
    head, row = result.output.strip().splitlines()
    assert head.split(" | ") == [
        "capacity",
        DEFAULT_POLICY,
        "lru",
        "A0 oracle",
        "belady",
        "gap closed",
    ]
    assert row.startswith("5% (")


def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(replay_command, ["--synthetic", "chat", "--policy", "mru"]).exit_code == 2
    assert runner.invoke(replay_command, []).exit_code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = runner.invoke(replay_command, ["--trace", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:1" in result.output


def brute_force_max_hits(trace: list[Request], capacity: int) -> int:
    """Most prefix hits any caching schedule gets (each miss: skip it, or evict anything)."""
    best: dict[tuple[int, frozenset[int]], int] = {}

    def after(r: int, cached: frozenset[int]) -> int:
        if r == len(trace):
            return 0
        if (r, cached) in best:
            return best[(r, cached)]
        ids = trace[r].hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in cached:
            hits += 1
        states = {cached}
        for b in ids:
            grown = set()
            for s in states:
                if b in s:
                    grown.add(s)
                    continue
                grown.add(s)  # bypass
                if len(s) < capacity:
                    grown.add(s | {b})
                else:
                    grown.update((s - {v}) | {b} for v in s)
            states = grown
        best[(r, cached)] = hits + max(after(r + 1, s) for s in states)
        return best[(r, cached)]

    return after(0, frozenset())


def test_belady_equals_brute_force_optimum_on_tiny_traces() -> None:
    """Belady with the depth tie-break is optimal under the prefix hit rule, not just a bound."""
    rng = random.Random(11)
    paths = [(1,), (1, 2), (1, 2, 3), (1, 4), (5,), (5, 6), (5, 6, 7), (8, 9)]
    for _ in range(40):
        trace = trace_of(*[list(rng.choice(paths)) for _ in range(7)])
        for capacity in (1, 2, 3):
            assert replay_belady(trace, capacity) == brute_force_max_hits(trace, capacity), (
                trace,
                capacity,
            )
