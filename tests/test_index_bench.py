"""`dpuctl bench index` runs and reports the fields the targets are judged on."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dpu_agent.cli import cli


def test_bench_index_json_reports_each_size() -> None:
    result = CliRunner().invoke(
        cli, ["bench", "index", "--records", "2000", "--records", "20000", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    sizes = [r["records"] for r in report["results"]]
    assert sizes == [2000, 20000]
    for r in report["results"]:
        assert 80 < r["bytes_per_record"] < 200
        assert 0 < r["lookup_ns_p50"] <= r["lookup_ns_p99"]


def test_bench_index_rejects_bad_size() -> None:
    result = CliRunner().invoke(cli, ["bench", "index", "--records", "0"])
    assert result.exit_code != 0 and "--records 0" in result.output
