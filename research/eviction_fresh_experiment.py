"""Sixth- to eighth-session experiment: `adaptive` options replayed on family cells, with the
best fixed policy of each cell and the registered default's figure computed in the same script
(cached in /tmp/eviction_fresh_cache.json: the replay is deterministic; delete the file after
changing the default). Sets: `fresh` (seeds 10 and 11 of every shape, generated in the sixth
session to choose its rule on), `fresh2` (seeds 12 and 13, generated in the seventh session to
choose on), `long` (six cells of seeds 9, 12 and 13 at 6,000 requests; capacities are the
set's own), `sample` (the repository's first 500 requests of the Mooncake synthetic trace),
`choose`, `report`, `held-out` (the family's), `held-out-8`, `held-out-9`, `held-out-14` and
`held-out-15`.
Usage, from the repository root (`{"hedge_z": null}` is the election alone, the fifth
version):

    python research/eviction_fresh_experiment.py fresh '{"hedge_z": 1.5}' [1,2,5,10]
"""

from __future__ import annotations

import json
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import distinct_blocks, replay_policy, replay_request
from dpu_agent.bench.replay_family import CHOOSE_SET, HELD_OUT_SET, REPORT_SET, FamilyTrace
from dpu_agent.eviction import POLICY_NAMES, AdaptivePolicy

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path("/tmp/eviction_fresh_cache.json")
MOONCAKE = FamilyTrace(
    role="report", path=ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
SAMPLE = FamilyTrace(
    role="report", path=ROOT / "tests" / "data" / "mooncake_synthetic_first500.jsonl"
)
SHAPES = ("chat", "docs", "agent", "mix", "conv", "scan")
FRESH = tuple(
    FamilyTrace(role="fresh", shape=s, requests=1500, seed=seed)
    for seed in (10, 11)
    for s in SHAPES
)
FRESH2 = tuple(
    FamilyTrace(role="fresh", shape=s, requests=1500, seed=seed)
    for seed in (12, 13)
    for s in SHAPES
)
# Seventh session: the same shapes four times longer, at the cells that failed at 1,500 requests
# (or 1,000-2,500): does the gap close when the trace carries more evidence?
LONG = tuple(
    (FamilyTrace(role="long", shape=shape, requests=6000, seed=seed), pct)
    for shape, seed, pct in (
        ("docs", 12, 5),
        ("docs", 12, 10),
        ("docs", 13, 2),
        ("docs", 13, 5),
        ("conv", 12, 10),
        ("conv", 9, 2),
    )
)
HELD_OUT_8 = tuple(FamilyTrace(role="held-out", shape=s, requests=1500, seed=8) for s in SHAPES)
HELD_OUT_9 = tuple(FamilyTrace(role="held-out", shape=s, requests=1500, seed=9) for s in SHAPES)
HELD_OUT_14 = tuple(FamilyTrace(role="held-out", shape=s, requests=1500, seed=14) for s in SHAPES)
HELD_OUT_15 = tuple(FamilyTrace(role="held-out", shape=s, requests=1500, seed=15) for s in SHAPES)
FIXED = [n for n in POLICY_NAMES if n != "adaptive"]


def baseline(spec: FamilyTrace, pct: int) -> tuple[str, float, float]:
    """(best fixed policy, its hit rate, the shipped adaptive's), in %."""
    trace = spec.load()
    accesses = sum(len(r.hash_ids) for r in trace)
    capacity = max(1, round(pct / 100 * distinct_blocks(trace)))
    rates = {n: replay_policy(trace, n, capacity) / accesses * 100 for n in FIXED}
    best = max(rates, key=lambda n: rates[n])
    shipped = replay_policy(trace, "adaptive", capacity) / accesses * 100
    return best, rates[best], shipped


def cell(args: tuple[FamilyTrace, int, dict[str, Any], Any]) -> tuple[Any, ...]:
    spec, pct, kw, base = args
    if base is None:
        base = baseline(spec, pct)
    trace = spec.load()
    accesses = sum(len(r.hash_ids) for r in trace)
    capacity = max(1, round(pct / 100 * distinct_blocks(trace)))
    policy = AdaptivePolicy(capacity, **kw)
    started = time.process_time()
    rate = sum(replay_request(policy, r, capacity) for r in trace) / accesses * 100
    us = (time.process_time() - started) / accesses * 1e6
    _, best, shipped = base
    return spec.name, pct, rate, rate - best, shipped - best, policy.switches, us, list(base)


def main() -> None:
    which, kw = sys.argv[1], json.loads(sys.argv[2])
    sets = {
        "fresh": FRESH,
        "fresh2": FRESH2,
        "sample": (SAMPLE,),
        "choose": CHOOSE_SET,
        "report": (*REPORT_SET, MOONCAKE),
        "held-out": HELD_OUT_SET,
        "held-out-8": HELD_OUT_8,
        "held-out-9": HELD_OUT_9,
        "held-out-14": HELD_OUT_14,
        "held-out-15": HELD_OUT_15,
    }
    pcts = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2, 5, 10]
    cache: dict[str, Any] = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    pairs = LONG if which == "long" else [(t, p) for t in sets[which] for p in pcts]
    cells = [(t, p, kw, cache.get(f"{t.name}|{p}")) for t, p in pairs]
    with get_context("fork").Pool(2) as pool:
        rows = pool.map(cell, cells, chunksize=1)
    for r in rows:
        cache[f"{r[0]}|{r[1]}"] = r[7]
    CACHE.write_text(json.dumps(cache))
    for r in rows:
        flag = "" if r[3] >= -0.5 else "  <-- under the bar"
        print(
            f"{r[0]:34s} {r[1]:3d}% {r[2]:6.2f} gap {r[3]:+6.2f} (shipped {r[4]:+6.2f}, "
            f"best {r[7][0]}) switches {r[5]:3d} {r[6]:5.1f} us{flag}"
        )
    within = sum(r[3] >= -0.5 for r in rows)
    worst = min(r[3] for r in rows)
    mean = sum(r[3] for r in rows) / len(rows)
    s_within = sum(r[4] >= -0.5 for r in rows)
    s_mean = sum(r[4] for r in rows) / len(rows)
    print(
        f"{which} {kw}: {within} of {len(rows)} within 0.5, worst {worst:+.2f}, "
        f"mean {mean:+.3f} | shipped {s_within}, worst {min(r[4] for r in rows):+.2f}, "
        f"mean {s_mean:+.3f}"
    )


if __name__ == "__main__":
    main()
