"""`dpuctl bench replay --timeline N`: what the adaptive default did over one replay.

Per window of N requests: each candidate's true hit rate (its own fixed-policy replay), the
adaptive cache's, the candidate it followed most, and each shadow's estimate (the hits its
miniature counted in the window, over the window's block accesses; at sampling rate R < 1 the
estimate is about R times the rate). Plus every change of leader, with the request it took
effect at. This is how the failing cells of docs/EVICTION.md were diagnosed: a wrong estimate
shows as a shadow column that differs from its policy's true column; following too late or
too long as a leader that trails another candidate's true rate for windows; the switch's
transient as windows right after a change where the adaptive rate is under its new leader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpu_agent.bench.replay import Request, distinct_blocks, replay_hits
from dpu_agent.eviction import AdaptivePolicy, make_policy

__all__ = ["adaptive_timeline", "format_timeline"]

WINDOW_REQUESTS_MAX = 1_000_000  # a window longer than any trace we replay is one row


def adaptive_timeline(trace: Sequence[Request], fraction: float, window: int) -> dict[str, Any]:
    """Windows of `window` requests at capacity `fraction` of the distinct blocks."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"capacity fraction must be in (0, 1], got {fraction}")
    if not 1 <= window <= WINDOW_REQUESTS_MAX:
        raise ValueError(f"window must be 1..{WINDOW_REQUESTS_MAX} requests, got {window}")
    capacity = max(1, round(fraction * distinct_blocks(trace)))
    adaptive = AdaptivePolicy(capacity)
    names = adaptive.candidates
    estimates: list[list[int]] = []  # per scored request: each shadow's hits
    leaders: list[str] = []

    def observe(hits: list[int], leader: str) -> None:
        estimates.append(list(hits))
        leaders.append(leader)

    adaptive.observer = observe
    got = replay_hits(trace, adaptive, capacity)
    true = {n: replay_hits(trace, make_policy(n, capacity), capacity) for n in names}
    accesses = [len(r.hash_ids) for r in trace]
    changes = [(0, names[0])]
    for i, leader in enumerate(leaders):
        if leader != changes[-1][1]:
            changes.append((i + 1, leader))  # takes effect at the next scored request
    windows = []
    for start in range(0, len(trace), window):
        acc = sum(accesses[start : start + window]) or 1
        lead = leaders[start : start + window] or [changes[-1][1]]
        windows.append(
            {
                "start": start,
                "adaptive": sum(got[start : start + window]) / acc,
                "true": {n: sum(true[n][start : start + window]) / acc for n in names},
                "estimate": {
                    n: sum(e[i] for e in estimates[start : start + window]) / acc
                    for i, n in enumerate(names)
                },
                "leader": max(set(lead), key=lead.count),
            }
        )
    total = sum(accesses) or 1
    return {
        "capacity_blocks": capacity,
        "sample_rate": adaptive.sample_rate,
        "switches": adaptive.switches,
        "leader_changes": changes,
        "hit_rate": {"adaptive": sum(got) / total, **{n: sum(true[n]) / total for n in names}},
        "windows": windows,
    }


def format_timeline(t: dict[str, Any]) -> str:
    names = list(t["hit_rate"])[1:]
    lines = [
        f"capacity {t['capacity_blocks']} blocks, sample rate {t['sample_rate']:g}, "
        f"{t['switches']} switches",
        "whole trace: " + ", ".join(f"{n} {v * 100:.2f}" for n, v in t["hit_rate"].items()),
        "leader from request: " + ", ".join(f"{i}: {n}" for i, n in t["leader_changes"]),
        "| from request | adaptive | followed | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} (shadow)" for n in names)
        + " |",
        "|---" * (3 + 2 * len(names)) + "|",
    ]
    for w in t["windows"]:
        lines.append(
            f"| {w['start']} | {w['adaptive'] * 100:.2f} | {w['leader']} | "
            + " | ".join(f"{w['true'][n] * 100:.2f}" for n in names)
            + " | "
            + " | ".join(f"{w['estimate'][n] * 100:.2f}" for n in names)
            + " |"
        )
    return "\n".join(lines)
