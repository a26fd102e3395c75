"""`dpuctl bench replay --cost`: CPU per engine put and lookup hit, per replay access, memory
per item, each policy against `prefix-run` (the bar's baseline), on a reduced scale."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import dpu_agent.bench.replay_cost as cost
from dpu_agent.bench.replay import replay_command


@pytest.fixture(autouse=True)
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "DRAM_CHUNKS", 64)
    monkeypatch.setattr(cost, "PUTS", 640)
    monkeypatch.setattr(cost, "REPLAY_REQUESTS", 60)
    monkeypatch.setattr(cost, "policy_memory_bytes", lambda name: 300.0)


def test_cost_reports_every_figure_against_prefix_run() -> None:
    report = cost.policy_cost(["lru"], rounds=1)
    assert list(report["policies"]) == ["prefix-run", "lru"]
    base = report["policies"]["prefix-run"]
    assert base["cpu_ratio_to_prefix_run_max"] == 1.0 and base["meets_bar"]
    for c in report["policies"].values():
        assert c["engine_put_us"] > 0 and c["engine_lookup_hit_us"] > 0
        assert c["engine_big_lookup_hit_us"] > 0
        assert c["replay_us_per_access"] > 0 and c["bytes_per_item"] == 300.0
        ratio = max(
            c["engine_put_us"] / base["engine_put_us"],
            c["engine_lookup_hit_us"] / base["engine_lookup_hit_us"],
            c["engine_big_lookup_hit_us"] / base["engine_big_lookup_hit_us"],
            c["replay_us_per_access"] / base["replay_us_per_access"],
        )
        assert c["cpu_ratio_to_prefix_run_max"] == ratio
        assert c["meets_bar"] == (ratio <= cost.CPU_RATIO_MAX)


def test_cost_cli_prints_a_table_and_json() -> None:
    monkey_rounds = ["--cost", "--policy", "lru"]
    result = CliRunner().invoke(replay_command, [*monkey_rounds, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["policies"]) == {"prefix-run", "lru"} and report["rounds"] == cost.ROUNDS
