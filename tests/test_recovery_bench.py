"""`dpuctl bench recovery` restarts a real engine from a written checkpoint + WAL."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dpu_agent.cli import cli


def test_bench_recovery_json() -> None:
    result = CliRunner().invoke(cli, ["bench", "recovery", "--records", "5000", "--json"])
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith('{"bench"')][-1]
    (r,) = json.loads(line)["results"]
    assert r["records"] == 5000
    assert r["checkpoint_records"] == 4500 and r["wal_records"] == 500
    assert r["restart_s"] > 0
    assert r["order_items"] == 5000  # every record named in the saved order was adopted
    assert r["restart_with_order_s"] > 0 and r["order_save_s"] > 0
    assert r["lookup_ms_p99_during_order_save"] > 0
    copies = json.loads(line)["order_copy_ms"]  # every policy that can hand a tier over
    assert {c["policy"] for c in copies} == {
        "lru",
        "lru2",
        "s3fifo",
        "prefix",
        "prefix-run",
        "elect",
    }
    assert all(c["items"] == 5000 and c["whole_tier_ms"] > 0 for c in copies)
    switches = json.loads(line)["switch_ms"]  # elect's first leader to each other candidate
    assert {r["to"] for r in switches} == {"prefix", "s3fifo"}
    assert all(r["items"] == 5000 and r["shipped_ms"] > 0 for r in switches)


def test_bench_recovery_spreads_records_over_tenants() -> None:
    """Each tenant's extents start at block 0 of its own device, as the engine allocates them:
    a restart drops none (the check that took them for overlaps once ran at every start)."""
    args = ["bench", "recovery", "--records", "3000", "--tenants", "3", "--sync-mib", "0"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith('{"bench"')][-1]
    (r,) = json.loads(line)["results"]
    assert r["records"] == 3000 and r["tenants"] == 3 and r["dropped_records"] == 0
    assert r["order_items"] == 1000  # tenant 1's records, all named in the saved order
