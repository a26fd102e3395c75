"""Human output says what a number is: rates as rates, a zero quota as none, evicted bytes,
checkpoint and backup times humanised, labels without the unit suffix their value already
shows, and `stats` grouped by tenant and tier instead of one flat dump. --json keeps raw values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.cli.ops import human, label
from dpu_agent.testing import AgentProcess, spawn_agent

REPO = Path(__file__).resolve().parents[1]
FLAT_STATS_ROWS = 120  # what `stats` printed as one table for one tenant before


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("fmt") / "var")
    yield a
    a.stop()


def dpuctl(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_DATA_DIR": str(agent.data_dir), "PYTHONPATH": str(REPO)}
    env.pop("DPUKV_CONFIG", None)
    return subprocess.run([sys.executable, "-c", "from dpu_agent.cli import main; main()", *args],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def _rows(table_text: str) -> dict[str, str]:
    """label -> value of a rich key/value table printed to a pipe."""
    out = {}
    for line in table_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 2 and cells[0]:
            out[cells[0]] = cells[1]
    return out


def test_config_show_renders_rates_as_rates_and_a_zero_quota_as_none(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\ndata_dir = "{tmp_path / "var"}"\n'
                   '[cluster]\nrebalance_bytes_per_s = 67108864\n')  # fmt: skip
    r = CliRunner().invoke(cli, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = _rows(r.stdout)
    assert rows["cluster.rebalance"] == "64.0 MiB/s", rows
    quota = next(v for k, v in rows.items() if k.startswith("tenants.") and k.endswith(".quota"))
    assert quota == "none"
    raw = json.loads(CliRunner().invoke(cli, ["config", "show", "--config", str(cfg),
                                              "--json"]).stdout)  # fmt: skip
    assert raw["cluster"]["rebalance_bytes_per_s"] == 64 << 20


def test_evict_checkpoint_and_backup_numbers_are_humanised() -> None:
    assert human("evicted", 3 << 20) == "3.0 MiB"
    assert human("checkpoint.seconds", 0.0042) == "0.0042 s"
    assert human("backup.created_unix", 1_790_000_000.5).startswith("2026-")
    assert label("backup.created_unix", 1_790_000_000.5) == "backup.created"
    assert label("backup.records", 7) == "backup.records" and human("backup.records", 7) == "7"


def test_status_labels_drop_unit_suffixes_and_stats_are_grouped(agent: AgentProcess) -> None:
    r = dpuctl(agent, "status")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert "uptime" in rows and rows["uptime"].endswith("s")
    assert "uptime_s" not in rows and "capacity_bytes" not in rows and "capacity" in rows
    assert "restore" not in rows  # no restore was interrupted: no empty row
    assert all(v.strip() for v in rows.values()), rows
    r = dpuctl(agent, "stats")
    assert r.returncode == 0, r.stderr
    for title in ("stats (all tenants)", "tenant default", "tiers", "recovery"):
        assert title in r.stdout, r.stdout
    assert "tenants.default.tiers" not in r.stdout  # no flattened dump
    assert len(r.stdout.splitlines()) < FLAT_STATS_ROWS
