"""The replay through the real Engine gives the standalone simulator's hits on lru, lru2, arc,
s3fifo, clock and prefix where the simulator's one extra rule (the blocks of the request in
flight are not evicted) does not come into play, as on this short trace at 5%; it only holds
when the engine keeps a chunk's policy identity across eviction and return. (On the whole
Mooncake trace at 1% the rule does come into play and the two differ: docs/EVICTION.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.bench.replay import distinct_blocks, load_trace, replay_policy
from dpu_agent.bench.replay_engine import replay_engine

TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_first500.jsonl"
REQUESTS = 300  # about 7,700 block accesses: several turnovers of a 5% cache


@pytest.mark.parametrize("policy", ["lru", "lru2", "arc", "s3fifo", "clock", "prefix"])
def test_engine_replay_gives_the_simulators_hits(tmp_path: Path, policy: str) -> None:
    trace = load_trace(TRACE)[:REQUESTS]
    capacity = distinct_blocks(trace) * 5 // 100
    got = replay_engine(trace, policy, capacity, data_dir=tmp_path)
    assert got.hits == replay_policy(trace, policy, capacity)
    assert got.hits > 0
    assert sum(got.hits_by_tier.values()) == got.hits
    assert got.accesses == sum(len(r.hash_ids) for r in trace)


def test_engine_replay_rejects_an_empty_cache(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one block"):
        replay_engine(load_trace(TRACE)[:1], "lru", 0, data_dir=tmp_path)
