"""Research, not packaged: `prefix`'s starting probation share, old (S3-FIFO's 10%) against new
(25%), on one family seed: every fixed policy and `elect` at each share, each `elect` judged
against the fixed policies of its own version (docs/EVICTION.md, "Probation's starting share").

    PYTHONPATH=$PWD python research/probation_start.py --seed 262167

The development data's figures come from `research/elect_choose.py` (its cache of the fixed
policies is per version: v3 is the 25% start).
"""

from __future__ import annotations

import argparse
import functools
from multiprocessing import Pool
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import DEFAULT_FRACTIONS, distinct_blocks, replay_hits
from dpu_agent.bench.replay_family import (
    BAR_POINTS,
    SEPARABLE_Z,
    FamilyTrace,
    _segments,
    _set,
    fixed_names,
    separation_z,
)
from dpu_agent.eviction import _elect, make_policy
from dpu_agent.eviction._prefix import PrefixPolicy

MOONCAKE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
SHARES = (0.1, 0.25)  # before, after


def _run(args: tuple[tuple[FamilyTrace, float], float]) -> dict[str, Any]:
    (spec, fraction), share = args
    # this worker's `prefix`, the fixed policy and `elect`'s candidate, starts at `share`
    assert PrefixPolicy.__init__.__kwdefaults__ is not None
    PrefixPolicy.__init__.__kwdefaults__["probation_fraction"] = share
    _elect._CANDIDATE_FACTORIES["prefix"] = functools.partial(
        PrefixPolicy, probation_fraction=share
    )
    trace = spec.load()
    capacity = max(1, round(fraction * distinct_blocks(trace)))
    hits = {
        name: [
            h
            for part in _segments(spec, trace)
            for h in replay_hits(part, make_policy(name, capacity), capacity)
        ]
        for name in [*fixed_names(), "elect"]
    }
    return {"accesses": sum(len(r.hash_ids) for r in trace), "hits": hits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    traces = [*_set("choose", a.seed, 1500), FamilyTrace(role="choose", path=MOONCAKE)]
    cells = [(t, f) for t in traces for f in DEFAULT_FRACTIONS]
    with Pool(a.jobs) as pool:
        got = pool.map(_run, [(c, s) for s in SHARES for c in cells], chunksize=1)
    n = len(cells)
    for k, share in enumerate(SHARES):
        within_d = decided = within_u = under = 0
        gaps: list[float] = []
        for i, (spec, fraction) in enumerate(cells):
            r = got[k * n + i]
            acc = r["accesses"]
            fixed = {m: h for m, h in r["hits"].items() if m != "elect"}
            rates = {m: sum(h) / acc * 100 for m, h in fixed.items()}
            best = max(rates, key=rates.__getitem__)
            mine = sum(r["hits"]["elect"]) / acc * 100
            gap, lru_gap = mine - rates[best], mine - rates["lru"]
            sep = separation_z(fixed, acc)
            dec = sep is not None and sep[0] >= SEPARABLE_Z
            ok = gap >= -BAR_POINTS
            decided += dec
            within_d += dec and ok
            within_u += (not dec) and ok
            under += lru_gap < 0
            gaps.append(gap)
            if (dec and not ok) or lru_gap < 0:
                print(f"  {share:g}: {spec.name} {fraction * 100:g}%: gap {gap:+.2f} ({best}) "
                      f"vs LRU {lru_gap:+.2f}{' decided' if dec else ''}")  # fmt: skip
        print(
            f"elect, prefix starting at {share:g}: decided within {within_d}/{decided}, "
            f"undecided within {within_u}/{n - decided}, under LRU {under}/{n}, misses "
            f"{decided - within_d + under}, mean gap {sum(gaps) / n:+.3f}, worst {min(gaps):+.2f}"
        )


if __name__ == "__main__":
    main()
