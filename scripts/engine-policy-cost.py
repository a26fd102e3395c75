"""CPU per engine operation with each eviction policy: `put_chunk` (with evictions) and a
lookup hit, 4 KiB chunks, a DRAM tier of 4,000 chunks and an NVMe tier of 16,000, chunks put in
chains of 16 (each chunk's parent is the previous one), then every resident chain looked up.
Policies alternate in rounds so a noisy box loads them alike; prints the median per policy.
Usage, from the repository root:

    python scripts/engine-policy-cost.py [rounds] [policy ...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from dpu_agent.engine import Engine, EngineConfig

BS = 4096
DRAM_CHUNKS = 4000
PUTS = 12_000  # three DRAM turnovers: most puts evict (demote) one chunk
CHAIN = 16


def one(policy: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(
            data_dir=Path(tmp),
            dram_bytes=DRAM_CHUNKS * BS,
            nvme_bytes=4 * DRAM_CHUNKS * BS,
            eviction_policy=policy,
            tenants={"t": 0},
        )
        eng = Engine(cfg)
        try:
            data = bytes(BS)
            keys = [i.to_bytes(16, "little") for i in range(PUTS)]
            started = time.process_time()
            for i, key in enumerate(keys):
                parent = keys[i - 1] if i % CHAIN else None
                eng.put_chunk("t", key, data, parent)
            put_us = (time.process_time() - started) / PUTS * 1e6
            lookups = 0
            started = time.process_time()
            for c in range(0, PUTS, CHAIN):
                result = eng.lookup("t", keys[c : c + CHAIN], lease=False)
                lookups += len(result.hits)
            hit_us = (time.process_time() - started) / max(1, lookups) * 1e6
            return put_us, hit_us
        finally:
            eng.close()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    policies = sys.argv[2:] or ["prefix-run", "adaptive"]
    got: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    for _ in range(rounds):
        for p in policies:
            got[p].append(one(p))
    for p, runs in got.items():
        put = statistics.median(r[0] for r in runs)
        hit = statistics.median(r[1] for r in runs)
        print(f"{p:10s} put_chunk {put:6.1f} us, lookup hit {hit:6.1f} us per chunk", end="")
        print(f" (median of {rounds} rounds)")


if __name__ == "__main__":
    main()
