"""`dpuctl bench nvme` runs end to end (tiny, bounded) and prints the documented JSON."""

from __future__ import annotations

import json

from click.testing import CliRunner
from spdk_peer import needs_spdk

from dpu_agent.bench.nvme import run_bench
from dpu_agent.cli import cli

KEYS = {"target", "op", "io_kib", "qd", "queues", "encrypted", "gbps", "ratio", "ceiling_gbps"}


def test_run_bench_reads_and_writes_the_agents_tier_stack() -> None:
    report = run_bench(
        seconds=0.2, sizes_kib=(128,), qds=(2,), targets=("agent-dram", "agent-nvme")
    )
    assert report["socket_ceiling_gbps"] > 0
    rows = report["results"]
    assert [(r["target"], r["op"], r["io_kib"], r["qd"], r["queues"]) for r in rows] == [
        ("agent-dram", "write", 128, 2, 1),
        ("agent-dram", "read", 128, 2, 1),
        ("agent-nvme", "write", 128, 2, 1),
        ("agent-nvme", "read", 128, 2, 1),
    ]
    for r in rows:
        assert KEYS <= set(r) and r["encrypted"] is True
        assert r["gbps"] > 0 and r["ratio"] > 0 and r["ceiling_gbps"] > 0


def test_without_spdk_the_report_says_why(monkeypatch) -> None:
    monkeypatch.delenv("SPDK_BIN", raising=False)
    report = run_bench(seconds=0.1, sizes_kib=(128,), qds=(1,), targets=("agent-dram", "spdk"))
    assert {r["target"] for r in report["results"]} == {"agent-dram"}
    assert report["targets"]["spdk"].startswith("absent: SPDK_BIN")


@needs_spdk
def test_spdk_column_in_the_same_run() -> None:
    report = run_bench(seconds=0.2, sizes_kib=(1024,), qds=(2,), targets=("agent-dram", "spdk"))
    by = {(r["target"], r["op"]): r for r in report["results"]}
    assert set(by) == {(t, op) for t in ("agent-dram", "spdk") for op in ("write", "read")}
    assert by[("agent-dram", "read")]["vs_spdk"] > 0 and "vs_spdk" not in by[("spdk", "read")]
    assert json.loads(json.dumps(report))["results"][0]["target"] == "agent-dram"


def test_dpuctl_bench_nvme_is_registered_and_bounds_its_seconds() -> None:
    result = CliRunner().invoke(cli, ["bench", "nvme", "--help"])
    assert result.exit_code == 0, result.output
    assert "--json" in result.output and "--queues" in result.output
    result = CliRunner().invoke(cli, ["bench", "nvme", "--seconds", "100"])
    assert result.exit_code == 2 and "100" in result.output  # a usage error, not 10 minutes


def test_a_target_that_fails_to_start_is_a_clean_error(tmp_path, monkeypatch) -> None:
    """SPDK's target dying at start ends the bench with exit 1 and a JSON error, no traceback."""
    fake = tmp_path / "spdk_tgt"
    fake.write_text("#!/bin/sh\necho 'no hugepages' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPDK_BIN", str(tmp_path))
    result = CliRunner().invoke(cli, ["bench", "nvme", "--json", "--seconds", "0.05"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["ok"] is False and "spdk_tgt did not listen" in doc["error"]
