"""Eighth-session experiment: how far can an election over the candidates get if switching
cost nothing? Every fixed candidate is replayed once per family cell (its per-request prefix
hits, cached under /tmp/eviction_offline_hits/); then an election of `adaptive`'s kind (decayed
pairwise sums, a margin and a z test, the return and the restart; no hedge, no refill) is
replayed on those hits over a grid of half-lives, z and margins. The leader's hits in a request
are its own candidate's, so a switch is free. The grid's best setting is picked twice: on the
choose set (then scored on the rest) and on every cell (hindsight, an upper bound for this kind
of rule on this family). It also prints, per shape and capacity, the mean and the spread over
the family's seeds of each candidate's hit rate minus `prefix-run`'s: where the mean is near
zero and the spread is half a point, the best fixed policy of a cell is its seed's draw. The
figures are in docs/EVICTION.md ("Eighth session").

    python research/eviction_offline_elections.py [--jobs 2]
"""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from dpu_agent.bench.replay import distinct_blocks, replay_hits
from dpu_agent.bench.replay_family import CHOOSE_SET, HELD_OUT_SET, REPORT_SET, FamilyTrace
from dpu_agent.eviction import make_policy
from dpu_agent.eviction._adaptive import DEFAULT_CANDIDATES

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = FamilyTrace(
    role="report", path=ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
CACHE = Path("/tmp/eviction_offline_hits")
FIXED = [*DEFAULT_CANDIDATES, "lru"]
PCTS = (1, 2, 5, 10)
BAR = 0.5
GRID = [
    {"half_life": hl, "z": z, "margin": m}
    for hl, z, m in itertools.product((2, 4, 8, 16), (0.5, 1.0, 1.5, 2.0), (0.005, 0.01, 0.02))
]
SHIPPED = {"half_life": 4, "z": 2.0, "margin": 0.01}  # the shipped election's thresholds


def cell_hits(args: tuple[FamilyTrace, int]) -> dict[str, Any]:
    spec, pct = args
    CACHE.mkdir(exist_ok=True)
    f = CACHE / f"{spec.name.replace(' ', '_').replace(',', '')}_{pct}.json.gz"
    if f.exists():
        with gzip.open(f, "rt") as fh:
            cached: dict[str, Any] = json.load(fh)
            return cached
    trace = spec.load()
    capacity = max(1, round(pct / 100 * distinct_blocks(trace)))
    d = {
        "name": spec.name,
        "role": spec.role,
        "pct": pct,
        "capacity": capacity,
        "accesses": sum(len(r.hash_ids) for r in trace),
        "sizes": [len(r.hash_ids) for r in trace],
        "hits": {n: replay_hits(trace, make_policy(n, capacity), capacity) for n in FIXED},
    }
    with gzip.open(f, "wt") as fh:
        json.dump(d, fh)
    return d


def elect(d: dict[str, Any], half_life: float, z: float, margin: float) -> float:
    """The default candidates' hits under a free-switch election: the points it ends under
    the best fixed policy of the cell (negative: under)."""
    hits = np.array([d["hits"][n] for n in DEFAULT_CANDIDATES], dtype=float)
    n = hits.shape[0]
    lead = np.zeros((n, n))
    sq = np.zeros((n, n))
    refs = since = total = 0.0
    leader, previous, got = 0, -1, 0.0
    capacity = d["capacity"]
    for t, size in enumerate(d["sizes"]):
        h = hits[:, t]
        got += h[leader]
        x = h[:, None] - h[None, :]
        lead += x
        sq += x * x
        refs += size
        since += size
        total += size
        if total >= 1.5 * capacity:  # the warm-up
            back = previous
            m = lead[back, leader] if back >= 0 else 0.0
            if back >= 0 and m > 0.005 * refs and m * m > sq[back, leader]:  # the return
                previous, leader = leader, back  # (keeps the evidence)
            else:
                best = int(np.argmax(lead[:, leader]))
                m = lead[best, leader]
                if best != leader and m > margin * refs and m * m > z * z * sq[best, leader]:
                    previous, leader = leader, best
                    for rows in (lead, sq):  # the restart
                        rows[best, :] = 0.0
                        rows[:, best] = 0.0
        if since >= half_life * capacity:
            since = 0.0
            refs /= 2.0
            lead /= 2.0
            sq /= 2.0
    best_fixed = max(sum(h) for h in d["hits"].values())
    return float((got - best_fixed) / d["accesses"] * 100)


def score(args: tuple[dict[str, Any], list[dict[str, Any]]]) -> list[float]:
    setting, cells = args
    return [elect(d, **setting) for d in cells]


def summary(gaps: list[float]) -> str:
    within = sum(g >= -BAR for g in gaps)
    return f"{within} of {len(gaps)} within {BAR}, mean {sum(gaps) / len(gaps):+.3f}"


def ties(cells: list[dict[str, Any]]) -> None:
    """Per shape and capacity: each candidate's rate minus `prefix-run`'s, mean and standard
    deviation over the synthetic seeds (points)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for d in cells:
        if not d["name"].endswith(" req"):
            continue  # a trace file, not a seed of a shape
        groups.setdefault((d["name"].split()[0], d["pct"]), []).append(d)
    for (shape, pct), ds in sorted(groups.items()):
        diffs = np.array(
            [
                [
                    (sum(d["hits"][n]) - sum(d["hits"]["prefix-run"])) / d["accesses"] * 100
                    for n in FIXED
                ]
                for d in ds
            ]
        )
        cols = ", ".join(
            f"{n} {m:+.2f}±{s:.2f}"
            for n, m, s in zip(FIXED, diffs.mean(0), diffs.std(0), strict=True)
            if n != "prefix-run"
        )
        print(f"{shape} at {pct}% ({len(ds)} seeds): {cols}")


def main() -> None:
    jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 2
    specs = [*CHOOSE_SET, *REPORT_SET, *HELD_OUT_SET, MOONCAKE]
    with get_context("fork").Pool(jobs) as pool:
        cells = pool.map(cell_hits, [(s, p) for s in specs for p in PCTS], chunksize=1)
        results = pool.map(score, [(g, cells) for g in [SHIPPED, *GRID]], chunksize=1)
    choose = [i for i, d in enumerate(cells) if d["role"] == "choose"]
    rest = [i for i, d in enumerate(cells) if d["role"] != "choose"]
    by_choose = max(
        range(len(results)),
        key=lambda k: (
            sum(results[k][i] >= -BAR for i in choose),
            sum(results[k][i] for i in choose),
        ),
    )
    hindsight = max(
        range(len(results)),
        key=lambda k: (sum(g >= -BAR for g in results[k]), sum(results[k])),
    )
    settings = [SHIPPED, *GRID]
    for label, k in (("shipped thresholds", 0), ("best on choose", by_choose)):
        print(
            f"{label} {settings[k]}: choose {summary([results[k][i] for i in choose])}; "
            f"the rest {summary([results[k][i] for i in rest])}; all {summary(results[k])}"
        )
    print(f"hindsight (best on all cells) {settings[hindsight]}: all {summary(results[hindsight])}")
    for i, g in enumerate(results[hindsight]):
        if g < -BAR:
            print(f"  under the bar: {cells[i]['name']} at {cells[i]['pct']}%: {g:+.2f}")
    ties(cells)


if __name__ == "__main__":
    main()
