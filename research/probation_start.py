"""Research, not packaged: `prefix`'s starting probation share, old (S3-FIFO's 10%) against new
(25%), on one family seed: the family bench's cells (every fixed policy, `elect` and Belady;
`replay_family.run_family`, fast path) at each share, so each `elect` is judged against the
fixed policies of its own version (docs/EVICTION.md, "Probation's starting share").

    PYTHONPATH=$PWD python research/probation_start.py --seed 262167

The development data's figures come from `research/elect_choose.py` (its cache of the fixed
policies is per version: v3 is the 25% start).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from dpu_agent.bench.replay_family import (
    BAR_POINTS,
    SEPARABLE_Z,
    FamilyTrace,
    _set,
    run_family,
    separation_summary,
)
from dpu_agent.eviction import _elect
from dpu_agent.eviction._prefix import PrefixPolicy

MOONCAKE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
SHARES = (0.1, 0.25)  # before, after


def _start_prefix_at(share: float) -> None:
    """`prefix`, the fixed policy and `elect`'s candidate, starts at `share` in this process
    and the workers it forks."""
    assert PrefixPolicy.__init__.__kwdefaults__ is not None
    PrefixPolicy.__init__.__kwdefaults__["probation_fraction"] = share
    _elect._CANDIDATE_FACTORIES["prefix"] = functools.partial(
        PrefixPolicy, probation_fraction=share
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    traces = [*_set("choose", a.seed, 1500), FamilyTrace(role="choose", path=MOONCAKE)]
    for share in SHARES:
        _start_prefix_at(share)
        rows = run_family(traces, default="elect", jobs=a.jobs, engine=False)
        misses = 0
        for r in rows:
            decided = (r["separation_z"] or 0.0) >= SEPARABLE_Z
            missed = (decided and r["gap_points"] < -BAR_POINTS) + (r["vs_lru_points"] < 0)
            misses += missed
            if missed:
                print(f"  {share:g}: {r['trace']} {r['capacity_fraction'] * 100:g}%: gap "
                      f"{r['gap_points']:+.2f} ({r['best_fixed']}) vs LRU "
                      f"{r['vs_lru_points']:+.2f}{' decided' if decided else ''}")  # fmt: skip
        gaps = [r["gap_points"] for r in rows]
        print(f"elect, prefix starting at {share:g}: {separation_summary(rows)}; misses {misses}, "
              f"mean gap {sum(gaps) / len(gaps):+.3f}, worst {min(gaps):+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
