"""`dpuctl bench datapath` end to end, tiny and bounded: every path and peer reports, with the
same number of streams for the agent, Redis and the sockets (no figure is checked: timing)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dpu_agent.bench.datapath import run_datapath, run_nixl_ab
from dpu_agent.cli import cli
from host_shim.transport import nixl_status


@pytest.mark.slow
def test_datapath_report_has_every_path_with_equal_streams() -> None:
    r = run_datapath(chunks=2, rounds=1, io_queues=2, lookups=5)
    assert r["streams"] == r["io_queues"] == 2
    for key in ("put_gbps", "get_gbps", "host_cpu_s_per_gib", "redis_set_gbps",
                "redis_get_gbps", "redis_set_1stream_gbps", "redis_get_1stream_gbps",
                "socket_ceiling_gbps", "socket_ceiling_1stream_gbps"):  # fmt: skip
        assert r[key] > 0, key
    assert r["host_copies"] == 1
    if nixl_status()["available"]:
        assert r["transport"] == "nvme-tcp+nixl"
        assert r["nixl_get_gbps"] > 0 and r["nixl_put_gbps"] > 0 and r["nixl_raw_gbps"] > 0
        assert r["nixl_host_copies"] == 0 and r["nixl_host_cpu_s_per_gib"] > 0
        assert r["nixl_get_vs_raw"] > 0
    assert ("mooncake_gbps" in r) != ("mooncake" in r["skipped"])
    assert ("lmcache_get_gbps" in r) != ("lmcache" in r["skipped"])


def test_datapath_transport_choice_is_checked() -> None:
    result = CliRunner().invoke(cli, ["bench", "datapath", "--transport", "rdma"])
    assert result.exit_code == 2 and "rdma" in result.output


def test_datapath_nixl_missing_is_a_json_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import dpu_agent.bench.datapath as dp

    monkeypatch.setattr(dp, "nixl_status", lambda: {"available": False, "reason": "not here"})
    result = CliRunner().invoke(cli, ["bench", "datapath", "--transport", "nixl", "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.output) == {"error": "--transport nixl: not here"}


@pytest.mark.slow
@pytest.mark.skipif(not nixl_status()["available"], reason="NIXL not installed")
def test_nixl_ab_alternates_raw_and_agent_and_reports_the_spread() -> None:
    """`--nixl-ab`: raw NIXL and the agent's get in every round, the same bytes (checked
    byte-exact), a ratio per round, its median within min..max, and CPU per GiB both sides."""
    r = run_nixl_ab(chunks=1, rounds=2)
    assert len(r["per_round"]) == 2 and r["streams"] == 1
    ratios = [row["ratio"] for row in r["per_round"]]
    assert r["nixl_get_vs_raw_min"] == min(ratios) and r["nixl_get_vs_raw_max"] == max(ratios)
    assert min(ratios) <= r["nixl_get_vs_raw"] <= max(ratios)
    assert all(row["raw_gbps"] > 0 and row["get_gbps"] > 0 for row in r["per_round"])
    assert r["get_agent_cpu_s_per_gib"] > 0 and r["get_worker_cpu_s_per_gib"] > 0
    assert r["raw_cpu_s_per_gib"] > 0 and r["decrypt_hash_cpu_s_per_gib"] > 0
    # the agent's decrypting and lane threads are a part of its CPU (by thread name; the
    # total counts 10 ms ticks, the split nanoseconds)
    split = r["get_agent_io_cpu_s_per_gib"] + r["get_agent_lane_cpu_s_per_gib"]
    tick_per_gib = 0.01 / (r["chunks"] * r["chunk_bytes"] / (1 << 30))
    assert 0 < split <= r["get_agent_cpu_s_per_gib"] + tick_per_gib + 0.01
    assert r["get_cores"] > 0 and r["raw_cores"] > 0
