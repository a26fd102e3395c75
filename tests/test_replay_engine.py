"""The replay through the real Engine gives the standalone simulator's hits on every policy,
at 2% (many requests longer than a tenth of the cache) and at 5%: the simulator is the engine
replay's fast path. It holds because both follow one rule (a put never evicts the chunk it
extends) and the engine keeps a chunk's policy identity across eviction and return."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.bench.replay import distinct_blocks, generate_trace, load_trace, replay_policy
from dpu_agent.bench.replay_engine import replay_engine
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.eviction import POLICY_NAMES

TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_first500.jsonl"
BS = 4096
REQUESTS = 300  # about 7,700 block accesses: several turnovers of a 5% cache


@pytest.mark.parametrize("pct", [2, 5])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_engine_replay_gives_the_simulators_hits(tmp_path: Path, policy: str, pct: int) -> None:
    trace = load_trace(TRACE)[:REQUESTS]
    capacity = distinct_blocks(trace) * pct // 100
    got = replay_engine(trace, policy, capacity, data_dir=tmp_path)
    assert got.hits == replay_policy(trace, policy, capacity)
    assert got.hits > 0
    assert sum(got.hits_by_tier.values()) == got.hits
    assert got.accesses == sum(len(r.hash_ids) for r in trace)


def test_engine_replay_rejects_an_empty_cache(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one block"):
        replay_engine(load_trace(TRACE)[:1], "lru", 0, data_dir=tmp_path)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_put_never_evicts_the_chunk_it_extends(tmp_path: Path, policy: str) -> None:
    """A chain longer than the tier, put chunk by chunk: every put finds its parent still
    there (prefix-aware policies evict the newest leaf first, which is that parent)."""
    cfg = EngineConfig(
        data_dir=tmp_path, dram_bytes=BS, nvme_bytes=8 * BS, eviction_policy=policy,
        tenants={"t": 0},
    )  # fmt: skip
    eng = Engine(cfg)
    try:
        eng.put_chunk("t", b"\xff" * 16, bytes(BS))  # fills the one DRAM block
        keys = [i.to_bytes(16, "little") for i in range(40)]
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else None
            eng.put_chunk("t", key, bytes(BS), parent=parent)
            if parent is not None:
                assert eng.lookup("t", [parent], lease=False).hits, (policy, i)
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["elect", "lru"])
def test_a_reopened_engine_finds_what_its_predecessor_kept(tmp_path: Path, policy: str) -> None:
    """`reopen_at`: the engine is closed and a new one opened on its directory mid-trace, as
    the agent restarts; recovery brings the NVMe tier's chunks back, so the first request
    after the restart hits what it would have hit without one (a cold restart hits nothing)."""
    trace = generate_trace("chat", REQUESTS, seed=2)  # hits all along
    capacity = distinct_blocks(trace) * 5 // 100
    half = REQUESTS // 2
    plain = replay_engine(trace, policy, capacity, data_dir=tmp_path)
    reopened = replay_engine(trace, policy, capacity, data_dir=tmp_path, reopen_at=half)
    assert reopened.per_request[:half] == plain.per_request[:half]
    assert reopened.per_request[half] == plain.per_request[half]  # the same chunks held
    cold = replay_engine(trace[half:], policy, capacity, data_dir=tmp_path)  # tiers empty
    assert sum(reopened.per_request[half : half + 10]) > sum(cold.per_request[:10])
    with pytest.raises(ValueError, match="reopen_at"):
        replay_engine(trace, policy, capacity, data_dir=tmp_path, reopen_at=REQUESTS + 1)


def test_a_crash_mid_trace_recovers_the_chunks_and_the_last_saved_order(tmp_path: Path) -> None:
    """`crash`: the replay ticks the engine (hits unchanged before the crash: one tier, the
    tick moves nothing), the stop leaves what a kill -9 leaves, and the start after it finds
    the same chunks and adopts the order its tick saved last."""
    from structlog.testing import capture_logs

    trace = generate_trace("chat", 2 * REQUESTS, seed=2)  # a save (60 s) before the crash
    capacity = distinct_blocks(trace) * 5 // 100
    half = REQUESTS
    assert trace[half].timestamp_ms > 61_000
    plain = replay_engine(trace, "elect", capacity, data_dir=tmp_path)
    with capture_logs() as logs:
        crashed = replay_engine(
            trace, "elect", capacity, data_dir=tmp_path, reopen_at=half, crash=True
        )
    assert crashed.per_request[: half + 1] == plain.per_request[: half + 1]
    adopted = [e for e in logs if e["event"] == "engine.policy_order_adopted"]
    assert len(adopted) == 1 and adopted[0]["previous_stop"] == "unclean"
    assert 0 < adopted[0]["items"] <= capacity
    for bad in ({"reopen_at": None}, {"reopen_at": half, "dram_blocks": 8}):
        with pytest.raises(ValueError, match="crash"):
            replay_engine(trace, "elect", capacity, data_dir=tmp_path, crash=True, **bad)
