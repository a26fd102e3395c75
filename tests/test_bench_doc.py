"""docs/BENCHMARKS.md is generated from the recorded runs in docs/bench, and every recorded run
says where and when it ran; `dpuctl bench --record` writes such runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.bench.doc import REQUIRED_META, DocError, ceiling_violations, load_records, render
from dpu_agent.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_md_is_what_docs_bench_generates() -> None:
    """The failure: docs/BENCHMARKS.md was a hand-kept notebook whose tables drifted from the
    runs. Now `dpuctl bench doc --check` fails when the page differs from docs/bench."""
    result = CliRunner().invoke(cli, ["bench", "doc", "--check", "--root", str(ROOT)])
    assert result.exit_code == 0, result.output


def test_every_recorded_run_has_its_meta_and_stays_under_its_ceilings() -> None:
    records = load_records(ROOT / "docs" / "bench")
    for name, record in records.items():
        assert set(REQUIRED_META) <= set(record["meta"]), name
        assert str(record["meta"]["command"]).startswith("dpuctl bench"), name
        assert ceiling_violations(record["report"]) == [], name


def _write(d: Path, name: str, report: object, meta: dict[str, object] | None = None) -> None:
    meta = meta if meta is not None else {
        "command": f"dpuctl bench {name} --json", "date_utc": "2026-12-03T14:00:00Z",
        "loadavg_1m": 1.5, "cpus": 2,
    }  # fmt: skip
    (d / f"{name}.json").write_text(json.dumps({"meta": meta, "report": report}))


def test_a_record_without_meta_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "crypto", {"gbps": 1.0}, meta={"command": "dpuctl bench crypto --json"})
    with pytest.raises(DocError, match="meta lacks date_utc, loadavg_1m, cpus"):
        render(tmp_path)


def test_a_figure_above_its_ceiling_without_a_reason_is_refused(tmp_path: Path) -> None:
    """A row's `gbps` is bounded by every `*ceiling_gbps` key beside it, and a report's
    declared `bounds` too; going over needs a `ceiling_exceeded_reason`."""
    _write(tmp_path, "nvme", {"results": [{"target": "a", "gbps": 3.0, "device_ceiling_gbps": 2}]})
    with pytest.raises(DocError, match=r"report.results\[0\]: gbps 3.0 > device_ceiling_gbps 2"):
        render(tmp_path)
    declared = {
        "sector_gbps": 5.0,
        "ceiling_gbps": 4.0,
        "bounds": {"sector_gbps": ["ceiling_gbps"]},
    }
    assert ceiling_violations(declared) == ["report: sector_gbps 5.0 > ceiling_gbps 4.0"]
    assert ceiling_violations({**declared, "ceiling_exceeded_reason": "why"}) == []
    ratio = {"get_gbps": 2.2, "socket_ceiling_gbps": 2.0, "get_vs_socket_ceiling": 1.1}
    assert ceiling_violations(ratio) == ["report: get_vs_socket_ceiling 1.1 > 1"]


def test_the_page_shows_command_date_load_prose_and_tables(tmp_path: Path) -> None:
    _write(tmp_path, "index", {"records": 10, "results": [{"n": 1, "us": 2.5}, {"n": 2, "us": 3}]})
    _write(tmp_path, "crypto", {"sector_gbps": 1.0, "ceiling_gbps": 2.0})
    (tmp_path / "crypto.md").write_text("Per-sector AES-XTS against one OpenSSL call.\n")
    (tmp_path / "_history.md").write_text("## History\n\nEarlier figures went.\n")
    page = render(tmp_path)
    assert page.index("## Crypto") < page.index("## Index") < page.index("## History")
    assert "```\ndpuctl bench crypto --json\n```" in page
    assert "Run 2026-12-03T14:00:00Z on 2 CPUs, load average 1.5 (1 min)" in page
    assert "Per-sector AES-XTS against one OpenSSL call." in page
    assert "| n | us |" in page and "| 2 | 3 |" in page


def test_record_writes_the_report_wrapped_with_its_run(tmp_path: Path) -> None:
    """`dpuctl bench --record PATH BENCH --json` prints what the bench prints and writes it
    wrapped with the command, date, load, CPUs and commit."""
    path = tmp_path / "index.json"
    argv = ["bench", "--record", str(path), "index", "--json", "--records", "1000"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    printed = json.loads(result.stdout)
    assert record["report"] == printed
    meta = record["meta"]
    assert meta["command"] == "dpuctl " + " ".join(argv)
    assert meta["cpus"] == os.cpu_count() and isinstance(meta["loadavg_1m"], float)
    assert meta["date_utc"].endswith("Z") and "commit" in meta


def test_record_without_json_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "--record", str(tmp_path / "x.json"), "index"])
    assert result.exit_code == 2 and "--json" in result.output
    assert not (tmp_path / "x.json").exists()


def test_datapath_targets_are_judged_on_the_recorded_run(tmp_path: Path) -> None:
    """The failure: the page said "targets met" from an early run with one Redis connection and
    a one-stream ceiling. Now the sentence is made from the recorded run's own ratios."""
    report = {"put_vs_redis_set": 2.5, "get_vs_redis_get": 1.5, "lookup_p50_us": 200.0}
    _write(tmp_path, "datapath", report)
    page = render(tmp_path)
    assert "| put over Redis SET, same streams | 2.5 | >= 2 | met |" in page
    assert "| get over Redis GET, same streams | 1.5 | >= 2 | NOT met |" in page
    assert "| lookup p50 us | 200 | <= 150 | NOT met |" in page
