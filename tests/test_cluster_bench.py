"""dpuctl bench cluster: the simulated figures hold the placement's promises; the gossip model
behaves; the real mode runs live Serf agents (full matrix only: ~20 s)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from dpu_agent.bench.cluster import gossip_rounds, run_real
from dpu_agent.cli import cli


def test_simulate_json_within_done_when_bounds() -> None:
    r = CliRunner().invoke(
        cli, ["bench", "cluster", "--simulate", "--nodes", "64", "--trials", "50", "--json"]
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["nodes"] == 64 and rep["keys"] == 64 * 2048
    assert 0.9 <= rep["moved_join_over_ideal"] <= 1.1
    assert 0.9 <= rep["moved_leave_over_ideal"] <= 1.1
    assert 1.0 <= rep["max_over_mean_load"] <= 1.1
    assert "lookup_hops" not in rep  # a constant, not a measurement
    # a view change plans at a cost proportional to the keys whose owners changed
    assert rep["view_change_ranked_fraction_join"] < 0.1
    assert rep["view_change_cpu_s_per_million_join"] < rep["full_rank_cpu_s_per_million"]
    assert 0 < rep["convergence_s_p50"] <= rep["convergence_s_p99"] < 5
    # a refresh is a delta by epoch: nothing changed costs a few dozen bytes, a join one row
    assert rep["refresh_unchanged_bytes"] < 200 < rep["refresh_one_join_bytes"] < 600
    assert rep["refresh_full_bytes"] > 64 * 150


def test_bad_node_count_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli, ["bench", "cluster", "--simulate", "--nodes", "1"])
    assert r.exit_code == 2 and "--nodes" in r.output


def test_gossip_rounds_grow_like_log_n() -> None:
    def mean(n: int) -> float:
        return float(np.mean([gossip_rounds(n, np.random.default_rng(s)) for s in range(100)]))

    small, big = mean(8), mean(1024)
    assert 2 <= small < big <= 12  # log4(1024) = 5 plus the tail


@pytest.mark.full
@pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary")
def test_real_mode_with_live_serf_agents() -> None:
    rep = run_real(4, trials=3, keys=1 << 14, replicas=2)
    assert rep["mode"] == "real" and rep["nodes"] == 4
    assert 0 < rep["convergence_s_p50"] < 30 and 0 < rep["failure_detect_s"] < 60
    assert 0.8 <= rep["moved_join_over_ideal"] <= 1.2
    assert rep["moved_bytes_join_ideal"] > 0 and rep["moved_bytes_over_ideal"] <= 1.1
