"""The trace family (choose and report sets), the Mooncake sample, the `mix` shape, and the
two-tier replay (hits per tier, promotion, expected load time)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.bench.replay import (
    BLOCK_BYTES_DEFAULT,
    SYNTHETIC_SHAPES,
    Request,
    generate_trace,
    load_trace,
    replay_command,
    replay_policy,
)
from dpu_agent.bench.replay_engine import replay_engine
from dpu_agent.bench.replay_family import (
    CHOOSE_SET,
    HELD_OUT_SET,
    REPORT_SET,
    FamilyTrace,
    format_family,
    policy_memory_bytes,
    run_family,
    separation_summary,
    separation_z,
)
from dpu_agent.bench.replay_tiers import format_two_tiers, two_tier_report
from dpu_agent.eviction import DEFAULT_POLICY, FIXED_POLICY_NAMES

SAMPLE = Path(__file__).parent / "data" / "mooncake_synthetic_first500.jsonl"


def trace_of(*requests: tuple[float, list[int]]) -> list[Request]:
    return [Request(t * 1000.0, tuple(ids)) for t, ids in requests]


def test_mooncake_sample_is_the_head_of_the_shared_trace() -> None:
    trace = load_trace(SAMPLE)
    assert len(trace) == 500
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(trace))
    # prefix-tree consistent: each id always follows the same parent
    parent: dict[int, int | None] = {}
    for r in trace:
        for prev, block in zip((None, *r.hash_ids), r.hash_ids, strict=False):
            assert parent.setdefault(block, prev) == prev


def test_mix_changes_shape_halfway() -> None:
    trace = generate_trace("mix", 400, seed=1)
    first, second = trace[:200], trace[200:]
    ids_first = {b for r in first for b in r.hash_ids}
    assert not ids_first & {b for r in second for b in r.hash_ids}  # new prompts, new ids
    assert generate_trace("docs", 200, seed=1)[0].hash_ids == first[0].hash_ids  # docs first
    roots = {r.hash_ids[0] for r in second}
    assert len(roots) > 3  # chat: many system prompts, where docs has 3


def test_family_sets_are_disjoint_and_cover_every_shape_short_and_restarting() -> None:
    sets = {"choose": CHOOSE_SET, "report": REPORT_SET, "held-out": HELD_OUT_SET}
    seeds = {role: {t.seed for t in traces} for role, traces in sets.items()}
    assert seeds == {"choose": {0}, "report": {1}, "held-out": {167840}}
    for role, traces in sets.items():
        assert {t.role for t in traces} == {role}
        assert {t.shape for t in traces} == set(SYNTHETIC_SHAPES)
        for shape in SYNTHETIC_SHAPES:
            mine = [t for t in traces if t.shape == shape]
            assert any(t.restart for t in mine)  # a cache that restarts cold halfway
            assert min(t.requests for t in mine) <= 300  # a trace of a few turnovers


def test_tenants_shape_interleaves_five_shapes_with_disjoint_ids() -> None:
    trace = generate_trace("tenants", 500, seed=2)
    assert len(trace) == 500
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(trace))
    owners = [{b >> 40 for b in r.hash_ids} for r in trace]
    assert all(len(o) == 1 for o in owners)  # a request belongs to one tenant
    assert {next(iter(o)) for o in owners} == {1, 2, 3, 4, 5}
    switches = sum(a != b for a, b in itertools.pairwise(owners))
    assert switches > 100  # interleaved, not one tenant after the other
    # tenant 1 is `chat` with its own seed, its ids moved into its namespace
    chat = [r for r, o in zip(trace, owners, strict=True) if o == {1}]
    assert [b - (1 << 40) for b in chat[0].hash_ids] == list(
        generate_trace("chat", 100, seed=10)[0].hash_ids
    )


def test_a_restart_cell_replays_each_half_with_a_cold_cache() -> None:
    spec = FamilyTrace(role="choose", shape="chat", requests=200, seed=3, restart=True)
    (row,) = run_family([spec], [0.5], engine=False)
    trace = spec.load()
    capacity = row["capacity_blocks"]
    accesses = sum(len(r.hash_ids) for r in trace)
    halves = replay_policy(trace[:100], "lru", capacity) + replay_policy(
        trace[100:], "lru", capacity
    )
    assert row["lru_hit_rate"] == halves / accesses
    assert halves < replay_policy(trace, "lru", capacity)  # the restart cost hits
    assert row["trace"].endswith(", restart")


def test_family_cell_through_the_engine_is_the_fast_paths() -> None:
    spec = FamilyTrace(role="choose", shape="conv", requests=120, seed=5)
    engine = run_family([spec], [0.05], engine=True)
    fast = run_family([spec], [0.05], engine=False)
    assert engine[0]["replayed_through"] == "engine"
    assert fast[0]["replayed_through"] == "simulator"
    for key in ("policies", "opt_hit_rate", "separation_z", "gap_points"):
        assert engine[0][key] == fast[0][key]


def test_family_through_the_engine_keeps_its_tiers_under_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--family --data-dir DIR`: every engine of the family replay keeps its tiers under DIR
    (tmpfs, in the documented commands); the family path used to drop the option."""
    import dpu_agent.bench.replay_engine as replay_engine_module

    made: list[str | None] = []
    real = replay_engine_module.tempfile.TemporaryDirectory

    def recording(*args: object, dir: str | None = None, **kwargs: object) -> object:
        made.append(None if dir is None else str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(replay_engine_module.tempfile, "TemporaryDirectory", recording)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:20]))
    data = tmp_path / "tiers"
    data.mkdir()
    result = CliRunner().invoke(
        replay_command,
        [
            "--family",
            "--family-set",
            "none",
            "--trace",
            str(trace),
            "--capacity-fraction",
            "0.5",
            "--data-dir",
            str(data),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert made and set(made) == {str(data)}, made


def test_conv_is_mostly_one_hit_blocks_with_a_reused_shared_set() -> None:
    """`conv`: most blocks are used once (one-off contexts, a conversation's last turn), a
    Zipf-skewed set of shared prefixes is used often, conversations come back after gaps."""
    trace = generate_trace("conv", 600, seed=1)
    uses: dict[int, int] = {}
    for r in trace:
        for b in r.hash_ids:
            uses[b] = uses.get(b, 0) + 1
    once = sum(1 for n in uses.values() if n == 1)
    assert once > 0.6 * len(uses)
    assert max(uses.values()) > 50  # the most popular shared prefix
    roots = {r.hash_ids[0] for r in trace}
    assert len(roots) > 50  # many shared prefixes, not a handful of system prompts


def test_scan_interrupts_reused_documents_with_runs_of_new_ones() -> None:
    trace = generate_trace("scan", 1000, seed=1)
    seen: set[int] = set()
    new_run = longest = again = 0
    for r in trace:
        body = set(r.hash_ids[2:-1])  # between the system prompt and the question
        fresh = bool(body) and not seen & body
        new_run = new_run + 1 if fresh else 0
        longest = max(longest, new_run)
        again += bool(body) and body <= seen
        seen.update(r.hash_ids)
    assert longest >= 20  # a scan: many requests in a row that bring only new documents
    assert again > 0.05 * len(trace)  # and documents asked again, whole


def test_run_family_reports_best_fixed_and_the_default_gap() -> None:
    traces = [
        FamilyTrace(role="choose", shape="chat", requests=150, seed=0),
        FamilyTrace(role="report", path=SAMPLE, requests=200),
    ]
    rows = run_family(traces, [0.05], DEFAULT_POLICY)
    assert [r["trace"] for r in rows] == ["chat seed 0, 150 req", f"{SAMPLE.name} (first 200)"]
    for row in rows:
        rates = row["policies"]
        assert set(rates) == {*FIXED_POLICY_NAMES, DEFAULT_POLICY}
        assert row["best_fixed_hit_rate"] == max(rates[n] for n in FIXED_POLICY_NAMES)
        assert rates[row["best_fixed"]] == row["best_fixed_hit_rate"]
        assert row["gap_points"] == pytest.approx(
            (row["default_hit_rate"] - row["best_fixed_hit_rate"]) * 100
        )
        assert row["vs_lru_points"] == pytest.approx((rates[DEFAULT_POLICY] - rates["lru"]) * 100)
        assert row["prefix_run_hit_rate"] == rates["prefix-run"]
        assert all(v <= row["opt_hit_rate"] + 1e-12 for v in rates.values())
    text = format_family(rows, {"lru": 100.0})
    assert "| report |" in text and "worst gap" in text and "lru 100 B" in text
    assert "| `prefix-run` | `lru` |" in text and "| decided |" in text
    for row in rows:
        z = row["separation_z"]
        nearest = row["nearest_outside_bar"]
        rates = row["policies"]
        if z is None:
            assert nearest is None
            assert min(rates.values()) >= row["best_fixed_hit_rate"] - 0.005
        else:
            assert rates[nearest] < row["best_fixed_hit_rate"] - 0.005
            assert all(
                v <= rates[nearest] or v >= row["best_fixed_hit_rate"] - 0.005
                for v in rates.values()
            )
            assert z > 0
    assert "cells the trace decides" in text and "under LRU" in text


def test_separation_z_is_a_paired_test_against_the_nearest_policy_outside_the_bar() -> None:
    # 10 accesses: a request's hit is 10 points. "a" leads "b" by 1 hit in every request
    # (a lead no noise explains), "c" is within the bar of "a", "d" trails by far more.
    hits = {
        "a": [3, 4, 3, 4],
        "b": [2, 3, 2, 3],
        "c": [3, 4, 3, 4],
        "d": [0, 0, 0, 0],
    }
    z, nearest = separation_z(hits, accesses=400) or (None, None)
    assert nearest == "b"  # not "d": the nearest policy the bar rejects is the hard one
    assert z == pytest.approx(4 / math.sqrt(4))
    # the same lead, but noisy: +3, -1, +3, -1 per request
    noisy = {"a": [3, 0, 3, 0], "b": [0, 1, 0, 1]}
    z, _ = separation_z(noisy, accesses=400) or (None, None)
    assert z == pytest.approx(4 / math.sqrt(20))
    # every policy within half a point: nothing to tell apart
    assert separation_z({"a": [1, 1], "b": [1, 0]}, accesses=400) is None


def test_separation_summary_counts_decided_and_undecided_cells_apart() -> None:
    rows: list[dict[str, float | None]] = [
        {"separation_z": 5.0, "gap_points": -0.1},
        {"separation_z": 5.0, "gap_points": -0.9},
        {"separation_z": 1.0, "gap_points": -0.9},
        {"separation_z": None, "gap_points": 0.0},
    ]
    for row in rows:
        row["vs_lru_points"] = 0.0
    text = separation_summary(rows)
    assert "within 0.5 points 1 of 2; undecided cells: 1 of 2 within" in text


@pytest.mark.slow
def test_default_within_half_a_point_of_the_best_fixed_policy_on_the_mooncake_sample() -> None:
    rows = run_family([FamilyTrace(role="report", path=SAMPLE)], [0.02, 0.1], engine=False)
    for row in rows:
        assert row["gap_points"] >= -0.5, row


def test_policy_memory_is_measured() -> None:
    lru = policy_memory_bytes("lru", 2000)
    assert 50 < lru < 2000
    assert policy_memory_bytes("lru2", 2000) > lru  # it keeps a history of evicted ids too


def test_replay_help_names_no_path_outside_the_repository() -> None:
    result = CliRunner().invoke(replay_command, ["--help"])
    assert result.exit_code == 0
    assert "shared/" not in result.output and "/work" not in result.output
    assert "--family" in result.output and "--dram-fraction" in result.output


def test_family_rejects_synthetic_and_bad_fractions() -> None:
    runner = CliRunner()
    result = runner.invoke(replay_command, ["--family", "--synthetic", "chat"])
    assert result.exit_code == 2 and "--family" in result.output
    result = runner.invoke(replay_command, ["--family", "--capacity-fraction", "2"])
    assert result.exit_code == 2 and "fraction" in result.output
    result = runner.invoke(replay_command, ["--family", "--dram-fraction", "0.1"])
    assert result.exit_code == 2 and "one tier" in result.output


# --- two tiers ---------------------------------------------------------------------------------


def test_the_nvme_only_baseline_is_the_single_tier_replay(tmp_path: Path) -> None:
    """The baseline row is the engine with its NVMe tier alone, as large as both tiers: the
    single-tier replay, whose hits the simulator gives (tests/test_replay_engine.py)."""
    trace = generate_trace("chat", 300, seed=1)
    report = two_tier_report(trace, "lru", 0.02, 0.1, bandwidths_gbps=(2.0, 1.0),
                             data_dir=tmp_path)  # fmt: skip
    both, alone = report["results"]
    assert (both["layout"], alone["layout"]) == ("dram+nvme", "nvme-only")
    assert alone["dram_hits"] == 0 and alone["promotions"] == alone["demotions"] == 0
    total = report["dram_blocks"] + report["nvme_blocks"]
    assert alone["nvme_blocks"] == total
    assert alone["nvme_hits"] == replay_policy(trace, "lru", total)
    assert both["dram_hits"] > 0 and both["demotions"] > 0  # DRAM serves, and fills NVMe


def test_a_chunk_reread_soon_from_nvme_is_promoted_by_the_tick_and_hits_in_dram(
    tmp_path: Path,
) -> None:
    """Through the engine: 30 blocks into a 20-block DRAM (the tick demotes to keep 10% free,
    puts beyond DRAM's room go to NVMe); block 25, on NVMe, read twice within 60 s is promoted
    by the next tick and hits in DRAM after; read 100 s apart it is not promoted."""
    fill = [(i * 0.01, [i]) for i in range(30)]
    soon = trace_of(*fill, (2, [25]), (3, [25]), (4, [25]), (5, [25]))
    r = replay_engine(soon, "lru", 64, dram_blocks=20, data_dir=tmp_path)
    assert r.promotions >= 1 and r.per_request[-4:] == [1, 1, 1, 1]
    assert r.hits_by_tier.get("dram", 0) >= 1 and r.hits_by_tier.get("nvme", 0) >= 1
    late = trace_of(*fill, (200, [25]), (400, [25]), (600, [25]))
    r = replay_engine(late, "lru", 64, dram_blocks=20, data_dir=tmp_path)
    assert r.promotions == 0 and r.hits_by_tier == {"nvme": 3}


def test_two_tier_report_load_time_from_bandwidths(tmp_path: Path) -> None:
    trace = generate_trace("chat", 300, seed=1)
    report = two_tier_report(trace, "lru", 0.02, 0.1, block_bytes=1000, bandwidths_gbps=(2.0, 1.0),
                             data_dir=tmp_path)  # fmt: skip
    both, alone = report["results"]
    for r in (both, alone):
        want = (r["dram_hits"] / 2e9 + r["nvme_hits"] / 1e9) * 1000 / len(trace) * 1e3
        assert r["model_load_ms_per_request"] == pytest.approx(want)
    assert alone["model_load_vs_nvme_only"] == 1.0
    assert both["model_load_vs_nvme_only"] < 1.0  # DRAM hits load faster
    for bad in ((0.0, 0.1), (0.02, 0.0), (1.5, 0.1)):
        with pytest.raises(ValueError, match="dram-fraction"):
            two_tier_report(trace, "lru", *bad)


def test_two_tier_cli_measures_bandwidths() -> None:
    args = ["--synthetic", "chat", "--requests", "200", "--dram-fraction", "0.02"]
    result = CliRunner().invoke(replay_command, [*args, "--nvme-fraction", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    inputs = report["model_inputs"]
    assert inputs["dram_gbps"] > 0 and inputs["nvme_gbps"] > 0
    assert inputs["bandwidths"] == "measured in this run"
    assert [r["layout"] for r in report["results"]] == ["dram+nvme", "nvme-only"]
    result = CliRunner().invoke(replay_command, args)
    assert result.exit_code == 2 and "--nvme-fraction" in result.output


def test_family_cli_prints_the_table_with_the_trace_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import dpu_agent.bench.replay_family as fam

    monkeypatch.setattr(fam, "CHOOSE_SET", (FamilyTrace(role="choose", shape="docs", requests=80),))
    monkeypatch.setattr(fam, "REPORT_SET", ())
    monkeypatch.setattr(fam, "HELD_OUT_SET", ())
    monkeypatch.setattr(fam, "policy_memory_bytes", lambda name: 1.0)
    args = ["--family", "--simulator", "--trace", str(SAMPLE), "--capacity-fraction", "0.05"]
    result = CliRunner().invoke(replay_command, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| trace | set |") and len(rows) == 1 + 2
    assert "| docs seed 0, 80 req | choose | 5% (" in rows[1] and "| trace | set |" in rows[0]
    assert f"| {SAMPLE.name} | report | 5% (" in rows[2]
    assert "cells the trace decides" in result.output
    result = CliRunner().invoke(replay_command, [*args, "--json"])
    report = json.loads(result.output)
    assert len(report["cells"]) == 2 and set(report["memory_bytes_per_item"]) == {
        *FIXED_POLICY_NAMES,
        DEFAULT_POLICY,
    }


def test_two_tier_load_time_is_a_model_output_printed_with_its_inputs() -> None:
    """The failure: "0.37 of the load time" moved from 0.63 with the same hits only because the
    measured DRAM bandwidth moved (4.5 -> 17.2 GB/s), and the report showed it as a result. Now
    the load figures are named model outputs and the bandwidths sit beside them as inputs."""
    trace = generate_trace("chat", 300, seed=1)
    slow = two_tier_report(trace, "lru", 0.02, 0.1, bandwidths_gbps=(4.5, 1.0))
    fast = two_tier_report(trace, "lru", 0.02, 0.1, bandwidths_gbps=(17.2, 1.0))
    assert [r["dram_hits"] for r in slow["results"]] == [r["dram_hits"] for r in fast["results"]]
    on_slow, on_fast = slow["results"][0], fast["results"][0]
    assert on_slow["model_load_vs_nvme_only"] != on_fast["model_load_vs_nvme_only"]
    assert not [k for r in slow["results"] for k in r if k.startswith("load")]
    assert slow["model_inputs"] == {
        "block_bytes": BLOCK_BYTES_DEFAULT, "dram_gbps": 4.5, "nvme_gbps": 1.0,
        "bandwidths": "given",
    }  # fmt: skip
    text = format_two_tiers(slow)
    assert "model inputs (given): DRAM 4.50 GB/s, NVMe 1.00 GB/s" in text
