"""The trace family `dpuctl bench replay --family` reports, and its table.

Every cell (trace, capacity) replays every fixed policy through the real Engine
(`replay_engine.policy_hits`; `engine=False` takes the fast path, the standalone simulator,
proven to give the same hits) and Belady's optimum, and gives the default's gap to the best
fixed policy and to LRU, with `prefix-run` and `lru` as columns of their own.

The family is split so that choosing and judging use different traces: the choose set (seed 0
of every shape, and the short and restarting variants of seed 0) is what the default was
chosen on; the report set (other seeds and lengths, and any trace file given) and the held-out
set (a seed generated only after choosing) judge it. Shapes: the synthetic ones of
`replay.generate_trace` (`tenants` is five shapes sharing one tier), short traces (a few cache
turnovers: 300 requests) and traces whose cache restarts cold halfway (`restart`).

Each cell says whether the trace can decide the bar at all (`separation_z`): the best fixed
policy against the best one more than `BAR_POINTS` under it, z = the sum of their per-request
hit differences over the square root of the sum of their squares (a paired test over the whole
trace). A cell is decided at z >= `SEPARABLE_Z` (2 standard errors with half the trace's
evidence); on the others any policy within noise of the best meets the bar by luck or misses it
by noise, so they are reported apart.
"""

from __future__ import annotations

import math
import operator
import os
import random
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import (
    DEFAULT_FRACTIONS,
    Request,
    distinct_blocks,
    generate_trace,
    load_trace,
    replay_belady,
)
from dpu_agent.bench.replay_engine import policy_hits
from dpu_agent.eviction import DEFAULT_POLICY, FIXED_POLICY_NAMES, POLICY_NAMES, make_policy

__all__ = [
    "CHOOSE_SET",
    "HELD_OUT_SET",
    "REPORT_SET",
    "FamilyTrace",
    "family_table",
    "format_family",
    "policy_memory_bytes",
    "run_family",
    "separation_summary",
    "separation_z",
]

JOBS_MAX = 64  # worker processes; one per core is the useful most
MEMORY_ITEMS = 20_000  # items held when measuring a policy's memory (tracemalloc is slow)
BAR_POINTS = 0.5  # the default within half a point of the best fixed policy
SEPARABLE_Z = 2.0 * math.sqrt(2.0)  # 2 standard errors with half the trace's evidence
SHORT_REQUESTS = 300  # a short trace: 2-6 turnovers of a 10% cache, many of a 1% one


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyTrace:
    role: str  # "choose", "report" or "held-out"
    shape: str = ""  # a synthetic shape, or "" for a trace file
    requests: int = 0  # of a trace file: its first `requests` (0: all of it)
    seed: int = 0
    path: Path | None = None
    restart: bool = False  # the cache restarts empty halfway through the trace

    @property
    def name(self) -> str:
        if self.path is not None:
            base = self.path.name + (f" (first {self.requests})" if self.requests else "")
        else:
            base = f"{self.shape} seed {self.seed}, {self.requests} req"
        return base + (", restart" if self.restart else "")

    def load(self) -> list[Request]:
        if self.path is not None:
            trace = load_trace(self.path)
            return trace[: self.requests] if self.requests else trace
        return generate_trace(self.shape, self.requests, self.seed)


SHAPES = ("chat", "docs", "agent", "mix", "conv", "scan", "tenants")


def _set(role: str, seed: int, requests: int) -> tuple[FamilyTrace, ...]:
    """Every shape at `requests`, plus short and restarting variants of each."""
    return tuple(
        t
        for shape in SHAPES
        for t in (
            FamilyTrace(role=role, shape=shape, requests=requests, seed=seed),
            FamilyTrace(role=role, shape=shape, requests=SHORT_REQUESTS, seed=seed),
            FamilyTrace(role=role, shape=shape, requests=requests, seed=seed, restart=True),
        )
    )


# Lengths keep one set (21 traces at four capacities, every fixed policy and Belady) to about
# ten CPU-minutes on the fast path; through the engine, several times that.
CHOOSE_SET = _set("choose", 0, 1500)
REPORT_SET = _set("report", 1, 1500)
# Drawn at random (2026-12-06T10:24:22Z) only after the default (`elect`, a restart beginning
# with its leader) was committed (docs/EVICTION.md, "Evaluation"). Seeds already seen judge
# nothing: 718791 (it decided the restart's leader), 286992 (the judging set before), 262167
# (it decided `prefix`'s starting share), 514295, 376429 (it decided between `elect` and
# `prefix-run`), 31 and 404198 (earlier held-out sets), 726997 (development since), 340071.
HELD_OUT_SET = _set("held-out", 167840, 1500)


def fixed_names() -> list[str]:
    """The policies the default is judged against: every one with a rule of its own."""
    return list(FIXED_POLICY_NAMES)


def separation_z(
    hits: dict[str, list[int]], accesses: int, bar_points: float = BAR_POINTS
) -> tuple[float, str] | None:
    """(z, name): how far the best policy of `hits` (per-request prefix hits, one list per
    policy over the same requests) stands from the best one more than `bar_points` under it,
    in standard errors of their paired per-request differences. None: every policy is within
    the bar, so there is nothing to tell apart."""
    totals = {n: sum(h) for n, h in hits.items()}
    best = max(totals, key=lambda n: totals[n])
    outside = [n for n in totals if (totals[best] - totals[n]) / accesses * 100 > bar_points]
    if not outside:
        return None
    nearest = max(outside, key=lambda n: totals[n])
    diffs = [a - b for a, b in zip(hits[best], hits[nearest], strict=True)]
    return sum(diffs) / math.sqrt(sum(d * d for d in diffs)), nearest


def _segments(spec: FamilyTrace, trace: list[Request]) -> list[list[Request]]:
    return [trace[: len(trace) // 2], trace[len(trace) // 2 :]] if spec.restart else [trace]


def _cell(args: tuple[FamilyTrace, float, str, bool, Path | None]) -> dict[str, Any]:
    """One trace at one capacity: every fixed policy and Belady (one process)."""
    spec, fraction, default, engine, data_dir = args
    trace = spec.load()
    accesses = sum(len(r.hash_ids) for r in trace)
    capacity = max(1, round(fraction * distinct_blocks(trace)))
    hits: dict[str, list[int]] = {}
    for name in dict.fromkeys([*fixed_names(), default]):
        # a restart: a new, empty cache, begun from what the policy kept (elect's leader)
        hits[name] = policy_hits(
            _segments(spec, trace), name, capacity, engine=engine, data_dir=data_dir
        )[0]
    rates = {n: sum(h) / accesses for n, h in hits.items()}
    fixed = {n: rates[n] for n in fixed_names()}
    best = max(fixed, key=lambda n: fixed[n])
    separation = separation_z({n: hits[n] for n in fixed}, accesses)
    opt = sum(replay_belady(part, capacity) for part in _segments(spec, trace)) / accesses
    return {
        "trace": spec.name,
        "role": spec.role,
        "capacity_fraction": fraction,
        "capacity_blocks": capacity,
        "replayed_through": "engine" if engine else "simulator",
        "default": default,
        "default_hit_rate": rates[default],
        "best_fixed": best,
        "best_fixed_hit_rate": fixed[best],
        "gap_points": (rates[default] - fixed[best]) * 100,
        "vs_lru_points": (rates[default] - rates["lru"]) * 100,
        "lru_hit_rate": rates["lru"],
        "prefix_run_hit_rate": rates["prefix-run"],
        "opt_hit_rate": opt,
        # None: every fixed policy within BAR_POINTS of the best (any of them meets the bar)
        "separation_z": None if separation is None else separation[0],
        "nearest_outside_bar": None if separation is None else separation[1],
        "policies": rates,
    }


def run_family(
    traces: Sequence[FamilyTrace],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    default: str = DEFAULT_POLICY,
    jobs: int = 1,
    *,
    engine: bool = True,
    data_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Every (trace, capacity) cell, in order; `jobs` worker processes (cells are independent);
    through the engine, its tiers in a temporary directory under `data_dir` (tmpfs is fast)."""
    if not 1 <= jobs <= JOBS_MAX:
        raise ValueError(f"jobs must be in 1..{JOBS_MAX}, got {jobs}")
    if default not in POLICY_NAMES:
        raise ValueError(f"unknown eviction policy {default!r}; valid: {', '.join(POLICY_NAMES)}")
    cells = [(t, f, default, engine, data_dir) for t in traces for f in fractions]
    if jobs == 1:
        return [_cell(c) for c in cells]
    with get_context("spawn" if os.name != "posix" else "fork").Pool(jobs) as pool:
        return pool.map(_cell, cells, chunksize=1)


def _decided(row: dict[str, Any]) -> bool:
    return (row["separation_z"] or 0.0) >= SEPARABLE_Z


def family_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per cell, hit rates in % of block accesses; z is the cell's
    separation (`separation_z`; "-": every fixed policy within the bar), "yes" when decided."""
    default = rows[0]["default"]
    lines = [
        f"| trace | set | capacity | default `{default}` | `prefix-run` | `lru` | best fixed | "
        "gap (points) | vs LRU (points) | z | decided | Belady |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        z = r["separation_z"]
        lines.append(
            f"| {r['trace']} | {r['role']} | {r['capacity_fraction'] * 100:g}% "
            f"({r['capacity_blocks']}) | {r['default_hit_rate'] * 100:.2f} | "
            f"{r['prefix_run_hit_rate'] * 100:.2f} | {r['lru_hit_rate'] * 100:.2f} | "
            f"{r['best_fixed']} {r['best_fixed_hit_rate'] * 100:.2f} | "
            f"{r['gap_points']:+.2f} | {r['vs_lru_points']:+.2f} | "
            f"{'-' if z is None else f'{z:.1f}'} | {'yes' if _decided(r) else 'no'} | "
            f"{r['opt_hit_rate'] * 100:.2f} |"
        )
    return "\n".join(lines)


def separation_summary(rows: Sequence[dict[str, Any]]) -> str:
    """Cells within the bar, among those that can be decided from the trace and the rest, and
    the cells under LRU."""
    decided = [r for r in rows if _decided(r)]
    rest = [r for r in rows if not _decided(r)]

    def within(cells: Sequence[dict[str, Any]]) -> int:
        return sum(r["gap_points"] >= -BAR_POINTS for r in cells)

    under_lru = [r for r in rows if r["vs_lru_points"] < 0]
    return (
        f"cells the trace decides (the best fixed policy {SEPARABLE_Z:.2f} standard errors "
        f"or more above every policy {BAR_POINTS:g} points under it): within {BAR_POINTS:g} "
        f"points {within(decided)} of {len(decided)}; undecided cells: {within(rest)} of "
        f"{len(rest)} within; under LRU: {len(under_lru)} of {len(rows)} cells"
    )


def format_family(rows: Sequence[dict[str, Any]], memory: dict[str, float]) -> str:
    """The table, the worst gap among decided cells, and memory per item held, per policy."""
    decided = [r for r in rows if _decided(r)] or list(rows)
    worst = min(decided, key=lambda r: r["gap_points"])
    return "\n".join(
        [
            family_table(rows),
            "",
            f"worst gap on a decided cell: {worst['gap_points']:+.2f} points ({worst['trace']} "
            f"at {worst['capacity_fraction'] * 100:g}%)",
            separation_summary(rows),
            f"memory per item held ({MEMORY_ITEMS} items, tracemalloc): "
            + ", ".join(f"{n} {b:.0f} B" for n, b in memory.items()),
        ]
    )


def policy_memory_bytes(name: str, items: int = MEMORY_ITEMS) -> float:
    """Bytes per item a policy holds with `items` items cached (tracemalloc, ids included),
    filled with chains of 1-16 blocks, half of them accessed again, then one item replaced per
    further insert for one turnover (so ghost lists and histories are full)."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        policy = make_policy(name, items)
        item, now = 1 << 40, 0.0
        for step in range(2 * items):
            if step % 8 == 0:
                now += 1.0
            parent = item if rng.random() < 0.9 else None
            item += 1
            if len(policy) >= items:
                victim = policy.victim(partial(operator.ne, parent))
                assert victim is not None
                policy.remove(victim)
                if victim == parent:
                    parent = None
            policy.insert(item, parent if parent in policy else None, now)
            if rng.random() < 0.5:
                policy.access(item, now + 0.5)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used / items
