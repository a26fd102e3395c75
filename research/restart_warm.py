"""Research, not packaged: what an agent restart that keeps its NVMe tier costs the hit rate.

Each trace of the family's shapes (one seed, 1,500 requests) is replayed through the real
Engine with no restart, and with the engine closed and reopened on its own directory halfway
(`replay_engine(..., reopen_at=)`: recovery, then the saved eviction order adopted,
`engine/_restart_order.py`); beside them, on the fast path, the restart as the engine did it
before the saved order (a model: the recovered chunks in a cold list, leaves first, oldest put
first, evicted before anything the policy holds and joining it as new when used; it gave the
engine's hits exactly on the cells it was checked on) and a cold restart (the tier emptied).
A crash halfway (`crash=True`: the order file of the engine's last periodic save, every 60 s
of the trace's time, and no clean-stop marker) is measured beside the clean restart; "before",
the old engine's restart, is also what a crash cost before the periodic save (the order was
thrown away after an unclean stop). Reported: hit rate of the second half, in %.

    PYTHONPATH=$PWD python research/restart_warm.py --seed 1
"""

from __future__ import annotations

import argparse
import operator
from collections.abc import Sequence
from functools import partial
from multiprocessing import Pool
from pathlib import Path

from dpu_agent.bench.replay import (
    Request,
    _prefix_hits,
    distinct_blocks,
    generate_trace,
    replay_request,
)
from dpu_agent.bench.replay_engine import replay_engine, restarted_hits
from dpu_agent.eviction import EvictionPolicy, make_policy

SHAPES = ("chat", "docs", "agent", "mix", "conv", "scan", "tenants")
FRACTIONS = (0.02, 0.05, 0.10)
POLICIES = ("elect", "prefix-run", "lru")


def _cold_list_restart(trace: Sequence[Request], name: str, capacity: int, half: int) -> list[int]:
    """The second half's hits with the restart the engine had before the saved order."""
    policy = make_policy(name, capacity)
    seq: dict[int, int] = {}
    parents: dict[int, int | None] = {}
    puts = 0
    for req in trace[:half]:
        prev = None
        for b in req.hash_ids:
            if b not in policy:  # a put: the record's seq is the journal's next
                seq[b], parents[b] = puts, prev
                puts += 1
            prev = b
        replay_request(policy, req, capacity)
    held = [i for i, _ in policy.resident()]
    held_set = set(held)
    is_parent = {parents[i] for i in held if parents.get(i) in held_set}
    cold = dict.fromkeys(sorted(held, key=lambda i: (i in is_parent, seq[i])))
    after = make_policy(name, capacity)
    after.restore(policy.state(), trace[half].timestamp_ms / 1000.0)

    class _Held:
        def __contains__(self, item: object) -> bool:
            return item in after or item in cold

    view, hits = _Held(), []
    for req in trace[half:]:
        hits.append(_prefix_hits(req.hash_ids, view))
        now, parent = req.timestamp_ms / 1000.0, None
        for b in req.hash_ids:
            if b in after:
                after.access(b, now)
            elif b in cold:
                del cold[b]
                after.insert(b, parent if parent in after else None, now)
            else:
                if not _make_room(after, cold, capacity, parent):
                    break
                after.insert(b, parent if parent in after else None, now)
            parent = b
    return hits


def _make_room(
    policy: EvictionPolicy, cold: dict[int, None], capacity: int, keep: int | None
) -> bool:
    while len(policy) + len(cold) >= capacity:
        victim = next((c for c in cold if c != keep), None)
        if victim is not None:
            del cold[victim]
            continue
        victim = policy.victim(partial(operator.ne, keep))
        if victim is None:
            return False
        policy.remove(victim)
    return True


def _cell(args: tuple[str, int, float, str]) -> str:
    shape, seed, fraction, name = args
    trace = generate_trace(shape, 1500, seed=seed)
    capacity = max(1, round(fraction * distinct_blocks(trace)))
    half = len(trace) // 2
    accesses = sum(len(r.hash_ids) for r in trace[half:])
    shm = Path("/dev/shm")
    none = replay_engine(trace, name, capacity, data_dir=shm).per_request[half:]
    warm = replay_engine(trace, name, capacity, data_dir=shm, reopen_at=half).per_request[half:]
    crash = replay_engine(
        trace, name, capacity, data_dir=shm, reopen_at=half, crash=True
    ).per_request[half:]
    before = _cold_list_restart(trace, name, capacity, half)
    cold = restarted_hits(
        [trace[:half], trace[half:]], lambda: make_policy(name, capacity), capacity
    )[half:]
    rates = [100.0 * sum(h) / accesses for h in (none, warm, crash, before, cold)]
    return f"| {shape} | {fraction:.0%} | {name} | " + " | ".join(f"{r:.2f}" for r in rates) + " |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--shape", action="append", help="default: every shape")
    a = ap.parse_args()
    cells = [
        (shape, a.seed, f, name)
        for shape in a.shape or SHAPES
        for f in FRACTIONS
        for name in POLICIES
    ]
    print("| trace | capacity | policy | no restart | restart, saved order | crash, last save "
          "| restart, before | cold restart |\n|---|---|---|---|---|---|---|---|",
          flush=True)  # fmt: skip
    with Pool(a.jobs) as pool:
        for line in pool.imap(_cell, cells):
            print(line, flush=True)


if __name__ == "__main__":
    main()
