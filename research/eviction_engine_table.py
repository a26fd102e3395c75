"""Hit ratio of each policy at each capacity, through the real Engine and through the standalone
simulator, on one trace. One JSON line per capacity: {policy: [engine, simulator, cpu_s]}.
Usage, from the repository root (tiers on tmpfs):

    PYTHONPATH=$PWD python research/eviction_engine_table.py TRACE [REQUESTS] [PCTS] [POLICIES]
    PYTHONPATH=$PWD python research/eviction_engine_table.py \\
        /work/shared/traces/mooncake_synthetic_trace.jsonl 100000 1,2,5,10 lru,prefix-run,adaptive
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dpu_agent.bench.replay import distinct_blocks, load_trace, replay_policy
from dpu_agent.bench.replay_engine import replay_engine


def main() -> None:
    trace = load_trace(Path(sys.argv[1]))
    trace = trace[: int(sys.argv[2])] if len(sys.argv) > 2 else trace
    pcts = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2,5,10").split(",")]
    policies = (sys.argv[4] if len(sys.argv) > 4 else "lru,prefix-run,adaptive").split(",")
    distinct = distinct_blocks(trace)
    accesses = sum(len(r.hash_ids) for r in trace)
    for pct in pcts:
        capacity = max(1, int(distinct * pct / 100))
        row = {}
        for policy in policies:
            started = time.process_time()
            engine = replay_engine(trace, policy, capacity, data_dir=Path("/dev/shm")).hits
            simulated = replay_policy(trace, policy, capacity)
            cpu = round(time.process_time() - started, 1)
            row[policy] = [round(engine / accesses, 4), round(simulated / accesses, 4), cpu]
        out = {"pct": pct, "capacity": capacity, "accesses": accesses, "rows": row}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
