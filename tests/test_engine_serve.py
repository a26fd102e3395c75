"""`dpuctl bench serve`, short: real `vllm serve` servers, plain against the tier (one real
agent over NVMe/TCP), 2 conversations x 2 turns with the engine's cache smaller than both.

Asserts what the bench reports rests on: every output of the tier configuration is plain
vLLM's (greedy), no request fails, and the prompt tokens the tier claims were served through
the connector (vLLM's own `external_prefix_cache_hits` counter), not by vLLM's prefix cache:
a fresh second server, whose own cache is empty, gets the conversations' histories from the
agent. `make test-engines` builds the venvs.
"""

from __future__ import annotations

import json

import pytest

from dpu_agent.bench.engines import engine_model, engine_python

ENGINE_TEST_TIMEOUT_S = 1800  # four vLLM servers start on 2 shared cores (40 s each quiet)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

if engine_python("vllm") is None or engine_model() is None:
    pytest.skip(
        "vLLM's venv (.venv-vllm) or the converted model (.engines/) is missing: run "
        "`make test-engines` (builds them and runs these tests)",
        allow_module_level=True,
    )


def test_serve_tier_outputs_identical_to_plain_and_cached_tokens_come_from_the_tier() -> None:
    from dpu_agent.bench.serve import Workload, run_serve

    wl = Workload(conversations=2, turns=2, turn_tokens=200, output_tokens=8, concurrency=2)
    # 8 blocks of 128 tokens: the two conversations (about 700 tokens each) never fit together
    report = run_serve(wl, ["plain", "tier"], engine_blocks=8, tier_mib=128)
    plain, tier = report["results"]
    for row in (plain, tier):
        assert "refused" not in row, row.get("refused")
        assert row["failed"] == 0, row["errors"]
        assert row["second_server"]["failed"] == 0
    assert tier["identical_to_plain"] is True
    assert plain["connector_hit_tokens"] == 0
    # the second server starts empty: what it finds cached, the tier served
    second = tier["second_server"]
    assert second["connector_hit_tokens"] > 0
    assert second["cached_tokens"] >= second["connector_hit_tokens"]
    assert plain["second_server"]["cached_tokens"] < second["cached_tokens"]
    assert (tier["tier_used_bytes"] or 0) > 0, tier.get("tier_used_error")
    assert tier["repeat"]["same_output"] is True


def test_serve_tier_nixl_moves_the_chunks_over_nixl_and_outputs_match_plain() -> None:
    """`tier-nixl` runs where the connector can load NIXL (the bench's own nixl_cu12 linked
    onto vLLM's path), and its chunks really take NIXL: the agent opened NIXL sessions and
    the server logged no fallback to NVMe/TCP."""
    from dpu_agent.bench.serve import Workload, run_serve
    from host_shim.transport import nixl_status

    if not nixl_status()["available"]:
        pytest.skip(f"NIXL does not load here: {nixl_status()['reason']}")
    wl = Workload(conversations=2, turns=2, turn_tokens=200, output_tokens=8, concurrency=2)
    report = run_serve(wl, ["plain", "tier-nixl"], engine_blocks=8, tier_mib=128)
    plain, tier = report["results"]
    for row in (plain, tier):
        assert "refused" not in row, row.get("refused")
        assert row["failed"] == 0, row["errors"]
    assert tier["identical_to_plain"] is True
    # what the servers' logs said about the data path, printed with any failure below
    keys = ("data_path_fallbacks", "degraded", "connector_warnings", "agent_warnings",
            "tier_used_bytes", "tier_used_error", "nixl_sessions", "second_server")  # fmt: skip
    # printed (pytest shows a failed test's output whole) and a string (a dict's repr in the
    # assertion is cut at 240 characters)
    why = json.dumps({k: tier.get(k) for k in keys}, default=str)
    print("tier-nixl:", why)
    assert "data_path_fallbacks" not in tier, why
    assert tier["nixl_sessions"] > 0, why
    assert tier["second_server"]["connector_hit_tokens"] > 0, why


def test_serve_throttled_tier_is_recomputed_unthrottled_tier_is_loaded() -> None:
    """Load or recompute under `vllm serve` (the CPU build forces the multiprocess executor:
    the scheduler and the worker are different processes). The worker's timed transfers and
    forwards reach the scheduler's cost model through vLLM's connector stats; the decisions
    come back out as the connector's counters on vLLM's /metrics. The same workload against
    the agent on loopback and against the agent behind a link shaped to THROTTLE_MBPS
    (a netns and `tc tbf`): a chunk of 256 tokens (11.8 MB) then takes ~2.4 s to load, longer
    than recomputing it, so every match is recomputed; on loopback every one loads."""
    import os
    import shutil

    from dpu_agent.bench.serve import THROTTLE_MBPS_DEFAULT, Workload, run_serve

    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("tier-throttled needs root and tc (a network namespace and a tbf qdisc)")
    throttle_mbps = THROTTLE_MBPS_DEFAULT
    # 4 conversations of ~330 tokens (3 blocks each) in 9 usable blocks: the last evicts the
    # first from vLLM's cache, so its second turn matches its first chunk in the tier only
    # think_s: a user's pause before the next turn, long enough for the four first-turn
    # chunks (47 MB) to be stored over the slow link (~9.4 s); without it a quiet box's
    # second turns come before their chunks are in the tier and nothing is matched to decide
    wl = Workload(conversations=4, turns=2, turn_tokens=300, output_tokens=8, concurrency=2,
                  think_s=14.0)  # fmt: skip
    report = run_serve(
        wl, ["tier", "tier-throttled"], engine_blocks=10, tier_mib=128, after=False,
        throttle_mbps=throttle_mbps,
    )  # fmt: skip
    tier, throttled = report["results"]
    for row in (tier, throttled):
        assert "refused" not in row, row.get("refused")
        assert row["failed"] == 0, row["errors"]
    assert throttled["outputs"] == tier["outputs"]  # recomputing changes no token
    fast, slow = tier["tier_decisions"], throttled["tier_decisions"]
    print(f"decisions: loopback {fast}, {throttle_mbps} Mbit/s {slow}")
    assert fast["load_decisions"] >= 1 and fast["recompute_decisions"] == 0, fast
    assert tier["connector_hit_tokens"] == fast["loaded_tokens"] > 0
    # the start-up probe measured the slow link before the first match: nothing was loaded;
    # a match was recomputed, or (once the link was measured slower per chunk than a prefill)
    # the prompt was not even looked up
    assert slow["load_decisions"] == 0, slow
    assert slow["recompute_decisions"] + slow["skipped_lookups"] >= 1, slow
    assert fast["skipped_lookups"] == 0 and fast["lookups"] >= fast["load_decisions"], fast
    assert throttled["connector_hit_tokens"] == 0
    assert slow["store_bytes"] > 0  # the tier still got every new chunk, off the forward
