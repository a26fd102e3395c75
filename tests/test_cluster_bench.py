"""dpuctl bench cluster: the simulated figures hold the placement's promises; the gossip model
behaves; the real mode runs live Serf agents (full matrix only: ~20 s)."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from dpu_agent.bench.cluster import gossip_rounds, run_real
from dpu_agent.bench.cluster_partition import partition_unavailable, run_partition
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
    rep = run_real(4, trials=3, keys=1 << 14, replicas=2, partition=False)
    assert rep["mode"] == "real" and rep["nodes"] == 4
    assert 0 < rep["convergence_s_p50"] < 30 and 0 < rep["failure_detect_s"] < 60
    assert 0.8 <= rep["moved_join_over_ideal"] <= 1.2
    assert rep["moved_bytes_join_ideal"] > 0 and rep["moved_bytes_over_ideal"] <= 1.1


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.full
@pytest.mark.timeout(400)
def test_real_partition_reports_call_latency_misses_and_heal_and_cleans_up() -> None:
    """The bench's silent-drop partition (3 agents in namespaces behind a bridge namespace,
    R=2): it reports every figure, the client routes around the cut node (its keys read from
    the other replica), the heal converges with nothing missing, and no namespace the bench
    made is left behind. Misses and the latency bound are not asserted here: on this shared
    box live members miss the deadline while starved (false downs), which the bench reports
    as it finds it; tests/test_cluster_partition.py asserts the bounds."""
    why = partition_unavailable()
    if why:
        pytest.skip(why)
    before = _namespaces()
    # 0.5 s: a live agent on this shared box can be silent for 0.25 s (test_cluster_partition)
    rep = run_partition(3, 2, node_deadline_s=0.5)
    print(rep)
    assert {n for n in _namespaces() - before if n.startswith("kvb")} == set()
    assert rep["partition_nodes"] == 3 and rep["node_deadline_ms"] == 500.0
    assert rep["partition_calls"] > 0 and rep["partition_reads_of_cut_node_keys"] > 0
    assert rep["partition_served_by_other_replica"] > 0
    assert rep["partition_client_marked_cut_node_down"] is True
    assert rep["partition_call_ms_p50"] <= rep["partition_call_ms_p99"] <= rep[
        "partition_call_ms_max"]  # fmt: skip
    assert rep["cut_node_says_cut_off_s"] is not None
    assert rep["heal_converged_s"] > 0 and rep["heal_misses"] == 0


def test_push_pull_interval_scales_as_memberlists_and_its_bytes_grow_with_members() -> None:
    from dpu_agent.bench.cluster import push_pull_bytes, push_pull_interval_s

    # memberlist pushPullScale: unchanged up to 32 members, then x(ceil(log2 n - 5) + 1)
    assert [push_pull_interval_s(n) for n in (2, 32, 33, 64, 65, 128, 1024)] == [
        30.0, 30.0, 60.0, 60.0, 90.0, 90.0, 180.0,
    ]  # fmt: skip
    small, large = push_pull_bytes(32), push_pull_bytes(1024)
    assert 32 * 200 < small["push_pull_state_bytes"] < 32 * 600  # names, tags and the HMAC
    assert large["push_pull_state_bytes"] > 30 * small["push_pull_state_bytes"]
    # the slower exchanges at 1,024 members do not make up for 32x the state
    assert large["push_pull_bytes_per_member_per_s"] > small["push_pull_bytes_per_member_per_s"]
