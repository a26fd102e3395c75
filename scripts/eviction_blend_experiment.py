"""Fifth-session experiment (second pass): the `adaptive` default blending the candidates'
victims (option `blend`, the sharpness in 1/points; `blend_floor`) on family cells; the best
fixed policy of each cell is read from the family table in docs/EVICTION.md (deterministic).
Usage, from the repository root:

    python scripts/eviction_blend_experiment.py choose '{"blend": 2}' [1,2,5,10]
"""

from __future__ import annotations

import json
import re
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import distinct_blocks, replay_request
from dpu_agent.bench.replay_family import CHOOSE_SET, HELD_OUT_SET, REPORT_SET, FamilyTrace
from dpu_agent.eviction import AdaptivePolicy

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(
    r"^\| (.+?) \| ([\w-]+) \| (\d+)% \((\d+)\) \| ([\d.]+) \| ([\w-]+) ([\d.]+) \|", re.M
)
BEST = {
    (m.group(1), int(m.group(3))): (float(m.group(7)), float(m.group(5)))
    for m in ROW.finditer((ROOT / "docs" / "EVICTION.md").read_text())
}
MOONCAKE = FamilyTrace(
    role="report", path=ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)


def cell(args: tuple[FamilyTrace, int, dict[str, Any]]) -> tuple[Any, ...]:
    spec, pct, kw = args
    trace = spec.load()
    accesses = sum(len(r.hash_ids) for r in trace)
    capacity = max(1, round(pct / 100 * distinct_blocks(trace)))
    policy = AdaptivePolicy(capacity, **kw)
    started = time.process_time()
    rate = sum(replay_request(policy, r, capacity) for r in trace) / accesses * 100
    best, shipped = BEST[(spec.name, pct)]
    us = (time.process_time() - started) / accesses * 1e6
    return spec.name, pct, rate, rate - best, shipped - best, policy.switches, us


def main() -> None:
    which, kw = sys.argv[1], json.loads(sys.argv[2])
    sets = {
        "choose": CHOOSE_SET,
        "report": (*REPORT_SET, MOONCAKE),
        "held-out": HELD_OUT_SET,
    }
    pcts = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2, 5, 10]
    cells = [(t, p, kw) for t in sets[which] for p in pcts]
    with get_context("fork").Pool(2) as pool:
        rows = pool.map(cell, cells, chunksize=1)
    for r in rows:
        flag = "" if r[3] >= -0.5 else "  <-- under the bar"
        print(f"{r[0]:34s} {r[1]:3d}% {r[2]:6.2f} gap {r[3]:+6.2f} (shipped {r[4]:+6.2f}) ", end="")
        print(f"switches {r[5]:3d} {r[6]:5.1f} us{flag}")
    within = sum(r[3] >= -0.5 for r in rows)
    worst = min(r[3] for r in rows)
    mean = sum(r[3] for r in rows) / len(rows)
    print(f"{kw}: {within} of {len(rows)} within 0.5, worst {worst:+.2f}, mean {mean:+.3f}")


if __name__ == "__main__":
    main()
