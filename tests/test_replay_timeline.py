"""`dpuctl bench replay --timeline`: what the adaptive default did, window by window."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dpu_agent.bench.replay import generate_trace, replay_command, replay_policy
from dpu_agent.bench.replay_timeline import adaptive_timeline, format_timeline


def test_timeline_rates_are_the_replays_own_and_leader_changes_match_switches() -> None:
    trace = generate_trace("conv", 400, seed=0)
    t = adaptive_timeline(trace, 0.05, 100)
    accesses = sum(len(r.hash_ids) for r in trace)
    cap = t["capacity_blocks"]
    assert t["hit_rate"]["adaptive"] == replay_policy(trace, "adaptive", cap) / accesses
    assert t["hit_rate"]["lru2"] == replay_policy(trace, "lru2", cap) / accesses
    assert len(t["windows"]) == 4 and [w["start"] for w in t["windows"]] == [0, 100, 200, 300]
    assert len(t["leader_changes"]) == t["switches"] + 1
    assert t["leader_changes"][0] == (0, "prefix-run")
    # at sampling rate 1 a shadow is its policy run alone: the first window (cache filling,
    # nothing evicted yet) estimates every candidate's true rate exactly
    assert t["sample_rate"] == 1.0
    first = t["windows"][0]
    assert first["estimate"] == pytest.approx(first["true"])
    text = format_timeline(t)
    assert "leader from request: 0: prefix-run" in text and "| 300 |" in text


def test_timeline_cli_needs_one_capacity_and_a_positive_window() -> None:
    runner = CliRunner()
    base = ["--synthetic", "chat", "--requests", "200", "--timeline"]
    two = runner.invoke(
        replay_command, [*base, "50", "--capacity-fraction", "0.02", "--capacity-fraction", "0.05"]
    )
    assert two.exit_code == 2 and "one --capacity-fraction" in two.output
    zero = runner.invoke(replay_command, [*base, "0", "--capacity-fraction", "0.02"])
    assert zero.exit_code == 2 and "window" in zero.output
    ok = runner.invoke(replay_command, [*base, "50", "--capacity-fraction", "0.02", "--json"])
    assert ok.exit_code == 0, ok.output
    assert len(json.loads(ok.output)["windows"]) == 4
