"""`dpuctl bench nvme` runs end to end (tiny, bounded) and prints the documented JSON."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dpu_agent.bench.nvme import run_bench
from dpu_agent.cli import cli


def test_run_bench_report_shape() -> None:
    report = run_bench(seconds=0.2, sizes_kib=(128,), qds=(2,), encrypted=(False,))
    assert report["socket_ceiling_gbps"] > 0
    rows = report["results"]
    assert [(r["op"], r["io_kib"], r["qd"], r["encrypted"]) for r in rows] == [
        ("write", 128, 2, False),
        ("read", 128, 2, False),
    ]
    for r in rows:
        assert r["gbps"] > 0 and r["ratio"] > 0 and r["ceiling_gbps"] > 0


def test_dpuctl_bench_nvme_is_registered() -> None:
    result = CliRunner().invoke(cli, ["bench", "nvme", "--help"])
    assert result.exit_code == 0, result.output
    assert "--json" in result.output


def test_report_is_json_serialisable() -> None:
    report = run_bench(seconds=0.1, sizes_kib=(128,), qds=(1,), encrypted=(True,))
    assert json.loads(json.dumps(report))["results"][0]["encrypted"] is True
