"""`dpuctl bench index`: memory per record and lookup latency of the engine's record index.

For each `--records N`: a fresh `RecordIndex` is filled with N random keys (batches of at most
`INSERT_BATCH_MAX`, so the columns grow as they do in service), then
- `bytes_per_record` = every array the index holds / N (target <= 128 at 10M);
- `lookup_ns_p50/p99`: single-key `find()` of random present keys, each timed on its own;
- `miss_ns_p50`: single-key `find()` of absent keys;
- `batch_ns_per_key`: `find_many()` of `BATCH_KEYS` keys (a lookup request's shape), per key;
- `remove_insert_ns_p50`: one remove plus one insert (churn), for the backward-shift path.
Lookup cost should be flat from 10k to 10M: the probe length depends on the load, not on N.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
import numpy as np

from dpu_agent.engine.index import COLUMNS, RecordIndex

__all__ = ["index_cmd", "run_index_bench"]

RECORDS_MAX = 50_000_000  # ~5 GB of index: beyond that the machine, not the index, is measured
INSERT_BATCH_MAX = 1 << 20
SAMPLES = 20_000  # single lookups timed per size
BATCH_KEYS = 256  # a 64k-token context in 256-token chunks
BATCHES = 200
CHURN_SAMPLES = 2_000


def _fill(index: RecordIndex, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    k0 = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    k1 = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    for start in range(0, n, INSERT_BATCH_MAX):
        end = min(n, start + INSERT_BATCH_MAX)
        m = end - start
        index.insert_many(
            {
                "k0": k0[start:end],
                "k1": k1[start:end],
                "tenant": np.ones(m, COLUMNS["tenant"]),
                "tier": np.ones(m, COLUMNS["tier"]),
                "lba": np.arange(start, end, dtype=np.uint64) * 8,
                "block_count": np.full(m, 8, COLUMNS["block_count"]),
                "length": np.full(m, 32768, COLUMNS["length"]),
            }
        )
    return k0, k1


def _keys(k0: np.ndarray, k1: np.ndarray, picks: np.ndarray) -> list[bytes]:
    words = np.stack((k0[picks], k1[picks]), axis=1).astype("<u8")
    raw = words.tobytes()
    return [raw[i * 16 : (i + 1) * 16] for i in range(len(picks))]


def _time_each(fn: Any, args: list[Any]) -> np.ndarray:
    out = np.empty(len(args), dtype=np.int64)
    clock = time.perf_counter_ns
    for i, a in enumerate(args):
        t0 = clock()
        fn(a)
        out[i] = clock() - t0
    return out


def _one_size(n: int, rng: np.random.Generator) -> dict[str, Any]:
    index = RecordIndex()
    t0 = time.perf_counter()
    k0, k1 = _fill(index, n, rng)
    insert_s = time.perf_counter() - t0
    assert len(index) == n, (len(index), n)
    hit_keys = _keys(k0, k1, rng.integers(0, n, size=SAMPLES))
    hits = _time_each(lambda key: index.find(1, key), hit_keys)
    assert all(index.find(1, key) >= 0 for key in hit_keys[:100])
    misses = _time_each(lambda key: index.find(2, key), hit_keys)  # same keys, other tenant
    batch_ns = []
    for _ in range(BATCHES):
        picks = rng.integers(0, n, size=BATCH_KEYS)
        t1 = time.perf_counter_ns()
        rows = index.find_many(1, k0[picks], k1[picks])
        batch_ns.append((time.perf_counter_ns() - t1) / BATCH_KEYS)
        assert (rows >= 0).all()
    churn = _churn(index, k0, k1, rng)
    return {
        "records": n,
        "bytes_per_record": round(index.nbytes / n, 1),
        "lookup_ns_p50": int(np.percentile(hits, 50)),
        "lookup_ns_p99": int(np.percentile(hits, 99)),
        "miss_ns_p50": int(np.percentile(misses, 50)),
        "batch_ns_per_key": int(np.median(batch_ns)),
        "remove_insert_ns_p50": int(np.percentile(churn, 50)),
        "insert_s": round(insert_s, 3),
    }


def _churn(
    index: RecordIndex, k0: np.ndarray, k1: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    picks = rng.choice(len(k0), size=min(CHURN_SAMPLES, len(k0)), replace=False)
    keys = _keys(k0, k1, picks)

    def swap(key: bytes) -> None:
        index.remove(index.find(1, key))
        index.insert(1, key, tier=1, lba=0, block_count=8, length=32768)

    return _time_each(swap, keys)


def run_index_bench(records: list[int], seed: int = 1) -> dict[str, Any]:
    for n in records:
        if not 0 < n <= RECORDS_MAX:
            raise click.BadParameter(f"--records {n}: give 1..{RECORDS_MAX}")
    rng = np.random.default_rng(seed)
    results = [_one_size(n, rng) for n in records]
    return {"bench": "index", "target_bytes_per_record": 128, "results": results}


def _table(report: dict[str, Any]) -> str:
    cols = [
        "records",
        "bytes_per_record",
        "lookup_ns_p50",
        "lookup_ns_p99",
        "miss_ns_p50",
        "batch_ns_per_key",
        "remove_insert_ns_p50",
        "insert_s",
    ]
    lines = ["  ".join(f"{c:>20}" for c in cols)]
    for r in report["results"]:
        lines.append("  ".join(f"{r[c]!s:>20}" for c in cols))
    return "\n".join(lines)


@click.command("index")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--records",
    "records",
    multiple=True,
    type=int,
    default=(10_000, 1_000_000),
    show_default=True,
    help="Index size; repeat for several sizes in one run.",
)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=1, show_default=True,
              help="RNG seed for the keys.")  # fmt: skip
def index_cmd(as_json: bool, records: tuple[int, ...], seed: int) -> None:
    """Bytes per record and lookup latency of the engine's record index."""
    report = run_index_bench(list(records), seed)
    click.echo(json.dumps(report) if as_json else _table(report))
