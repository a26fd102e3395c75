"""`dpuctl bench recovery`: how long an agent takes to restart with N persistent records.

The on-disk state is written by the journal's own code, without chunk data (restart never reads
chunk data): a checkpoint holding `N - wal` records, then a WAL segment with `wal` commit records
after it (the default `wal` is 10% of N; the engine checkpoints automatically every 16 MiB of
WAL, 180k frames, so 0.18 is the worst case at 1M). Chunks are 8 blocks (32 KiB) on a sparse NVMe
file. `restart_s` is the wall time of `Engine(config)`: keystore, devices, checkpoint load, WAL
replay, index and allocator rebuild, cold-list ordering. A sample of keys is looked up after.
Then the same restart with a saved eviction order naming ADOPT_ITEMS_MAX of the records
(`restart_with_order_s`: the adoption included), and the order saved again, as the tick does,
with lookups timed during the save against the same lookups idle.

`order_copy_ms`: what a save holds the engine lock for, per policy holding as many items as the
largest `--records` (random 64-bit items, as the engine's are hashes, put in chains of 16;
then a quarter as many steps, each a use of a held item or a put that evicts, as a full tier
sees): `resident_later()` of the whole tier (what a save copied
before) against `resident_later(ADOPT_ITEMS_MAX)` (what it copies: the hottest, all a restart
hands back), median of three.
"""

from __future__ import annotations

import gc
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from dpu_agent.bench.sync_stall import (
    BASELINE_SAMPLES,
    SYNC_MIB_MAX,
    _during,
    _lookup,
    _open_loop,
    _p,
    run_sync_stall,
)
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.engine._records import items_of
from dpu_agent.engine._restart_order import ADOPT_ITEMS_MAX, save_order
from dpu_agent.engine.index import COLUMNS
from dpu_agent.engine.journal import CHECKPOINT_COLUMNS, Journal, pack_commit
from dpu_agent.eviction import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ElectPolicy,
    EvictionPolicy,
    make_policy,
)
from dpu_agent.eviction._elect import CANDIDATES, SWITCH_ADOPT_MAX
from kvproto.control import TENANTS_MAX

__all__ = ["recovery_cmd", "run_recovery_bench"]

RECORDS_MAX = 10_000_000
BLOCKS_PER_CHUNK = 8
BS = 4096
SAMPLE_KEYS = 1000
TENANT = "bench"
# the policies that can hand a tier over (`resident_later`), each filled for `order_copy_ms`
COPY_POLICIES = ("lru", "lru2", "s3fifo", "prefix", "prefix-run", "elect")
COPY_CHAIN = 16


def _names(tenants: int) -> dict[int, str]:
    """Tenant id -> name: TENANT, then TENANT-2, TENANT-3, ..."""
    return {t: TENANT if t == 1 else f"{TENANT}-{t}" for t in range(1, tenants + 1)}


def _write_state(
    journal_dir: Path, n: int, wal: int, rng: np.random.Generator, tenants: int = 1
) -> np.ndarray:
    """Checkpoint of n - wal records plus a WAL of `wal` commits, record j of tenant
    1 + j % tenants, each tenant's extents from block 0 of its own device (as the engine
    allocates them); returns all keys (n, 2)."""
    keys = rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)
    owner = np.arange(n) % tenants + 1
    lbas = (np.arange(n) // tenants).astype(np.uint64) * BLOCKS_PER_CHUNK
    base = n - wal
    cols: dict[str, np.ndarray] = {
        name: np.zeros(base, COLUMNS[name]) for name in CHECKPOINT_COLUMNS
    }
    cols["k0"][:], cols["k1"][:] = keys[:base, 0], keys[:base, 1]
    cols["c0"][:] = rng.integers(0, 2**63, size=base, dtype=np.uint64)
    cols["lba"][:] = lbas[:base]
    cols["seq"][:] = np.arange(2, base + 2, dtype=np.uint64)
    cols["block_count"][:] = BLOCKS_PER_CHUNK
    cols["length"][:] = BLOCKS_PER_CHUNK * BS
    cols["tenant"][:] = owner[:base]
    cols["tier"][:] = 1
    cols["generation"][:] = 1
    # chains of one tenant: each record's parent is that tenant's record before it
    parent_k = np.roll(keys[:base], tenants, axis=0)
    cols["pk0"], cols["pk1"] = parent_k[:, 0].copy(), parent_k[:, 1].copy()
    cols["hp"] = ((np.arange(base) // tenants) % 16 != 0).astype("u1")  # 16-chunk prompts
    cols["pidx"] = np.where(cols["hp"] == 1, np.arange(base) - tenants, -1)
    journal = Journal(journal_dir)
    meta = {
        "tenants": {str(t): name for t, name in _names(tenants).items()},
        "quarantined": [],
        "next_seq": base + 2,
        "segment": 1,
    }
    journal.write_checkpoint(cols, meta)
    journal.open_segment(1)
    for j in range(base, n):
        key = keys[j].astype("<u8").tobytes()
        journal.append(
            pack_commit(
                int(owner[j]),
                j + 2,
                key,
                bytes(16),
                1,
                int(lbas[j]),
                BLOCKS_PER_CHUNK,
                BLOCKS_PER_CHUNK * BS,
                1,
                0,
                None,
            )
        )
    journal.close()
    return keys


def _one(
    n: int, wal: int, policy: str, rng: np.random.Generator, tenants: int = 1
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-recovery-") as tmp:
        data_dir = Path(tmp)
        keys = _write_state(data_dir / "journal", n, wal, rng, tenants)
        store = KeyStore(data_dir / "keys.json")
        for name in _names(tenants).values():
            store.current_generation(name)  # provision key generation 1
        cfg = EngineConfig(
            data_dir=data_dir,
            dram_bytes=1 << 20,
            nvme_bytes=-(-n // tenants) * BLOCKS_PER_CHUNK * BS,
            eviction_policy=policy,
        )
        t0 = time.perf_counter()
        eng = Engine(cfg)
        restart_s = time.perf_counter() - t0
        picks = rng.integers(0, -(-n // tenants), size=SAMPLE_KEYS) * tenants  # tenant 1's
        sample = [keys[i].astype("<u8").tobytes() for i in picks]
        try:
            rep = eng.recovery_report
            found = sum(len(eng.lookup(TENANT, [k]).hits) for k in sample)
            assert found == SAMPLE_KEYS, (found, SAMPLE_KEYS)
        finally:
            eng._commit.journal.close()  # no close(): that would checkpoint N records again
        return {
            "records": rep.records,
            "restart_s": round(restart_s, 3),
            "checkpoint_records": rep.checkpoint_records,
            "wal_records": rep.wal_records,
            "load_s": round(rep.load_s, 3),
            "index_s": round(rep.index_s, 3),
            "policy_s": round(rep.policy_s, 3),
            "policy": policy,
            "tenants": tenants,
            "dropped_records": rep.dropped_records,
            **_with_order(cfg, keys[::tenants], sample, rng),
        }


def _with_order(
    cfg: EngineConfig, keys: np.ndarray, sample: list[bytes], rng: np.random.Generator
) -> dict[str, Any]:
    """The same restart with a saved eviction order (`engine/_restart_order.py`): the hottest
    ADOPT_ITEMS_MAX records of tenant 1 (`keys`) named in `policy-order.npz`, as a save leaves
    it; then the order saved again (as the tick does every `policy_order_save_s`) while one
    client looks up in an open loop, against the same lookups idle."""
    named = keys[rng.permutation(len(keys))[:ADOPT_ITEMS_MAX]]
    order = list(zip(items_of(named[:, 0], named[:, 1]).tolist(),
                     (rng.random(len(named)) < 0.5).tolist(), strict=True))  # fmt: skip
    save_order([(TENANT, lambda: order)], cfg.journal_path)
    t0 = time.perf_counter()
    eng = Engine(cfg)
    restart_s = time.perf_counter() - t0
    try:
        look = _lookup(eng)
        gc.collect()  # the adoption's garbage is not the idle lookups' (nor the save's)
        idle = _open_loop(look, sample, threading.Event(), BASELINE_SAMPLES)
        saved: list[int] = []
        gc.collect()
        t0 = time.perf_counter()
        during = _during(lambda: saved.append(eng._save_policy_order()), look, sample)
        save_s = time.perf_counter() - t0
    finally:
        eng._commit.journal.close()
    return {
        "restart_with_order_s": round(restart_s, 3),
        "order_items": saved[0],
        "order_save_s": round(save_s, 3),
        "lookup_ms_p99_idle": _p(idle, 99),
        "lookup_ms_p99_during_order_save": _p(during, 99),
        "lookup_ms_max_during_order_save": _p(during, 100),
    }


_Steps = tuple[list[int], list[float], list[int]]


def _full_tier(policy: EvictionPolicy, steps: _Steps) -> EvictionPolicy:
    """`policy` holding a full tier: `steps`' items put in chains of COPY_CHAIN, then its
    steps, each a use of a held item or a put that evicts (as a full tier sees)."""
    ids, coins, picks = steps
    n = policy.capacity
    held = ids[:n]
    for i, item in enumerate(held):
        policy.insert(item, held[i - 1] if i % COPY_CHAIN else None, float(i // COPY_CHAIN))
    at = {item: i for i, item in enumerate(held)}
    now, fresh = float(n // COPY_CHAIN), n
    for j, (coin, pick) in enumerate(zip(coins, picks, strict=True)):
        if coin < 0.5:
            policy.access(held[pick], now + j)
            continue
        victim = policy.victim(lambda _item: True)
        assert victim is not None
        policy.remove(victim)
        slot = at.pop(victim)
        held[slot], at[ids[fresh]] = ids[fresh], slot
        policy.insert(ids[fresh], None, now + j)
        fresh += 1
    return policy


def _steps(n: int, rng: np.random.Generator) -> _Steps:
    """Random 64-bit items (the engine's are hashes) and a quarter as many steps."""
    ids = rng.integers(0, 2**63, size=n + n // 4, dtype=np.uint64).tolist()
    return ids, rng.random(n // 4).tolist(), rng.integers(0, n, size=n // 4).tolist()


def order_copy_ms(n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per policy, the ms `resident_later()` takes under the lock, whole tier against the
    hottest ADOPT_ITEMS_MAX, for a full tier of `n` items (the module's docstring)."""
    steps = _steps(n, rng)
    out: list[dict[str, Any]] = []
    for name in COPY_POLICIES:
        policy = _full_tier(make_policy(name, n), steps)
        out.append({
            "policy": name,
            "items": n,
            "whole_tier_ms": _median_ms(lambda p=policy: p.resident_later()),
            "hottest_ms": _median_ms(lambda p=policy: p.resident_later(ADOPT_ITEMS_MAX)),
            "hottest_items": ADOPT_ITEMS_MAX,
        })  # fmt: skip
        del policy
        gc.collect()
    return out


def switch_ms(n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The ms an `elect` switch holds its caller (a put or a lookup, under the engine lock),
    from the first leader to each other candidate, at a full tier of SWITCH_ADOPT_MAX items
    (the largest handed over: the longest stall as shipped) and of `n`: as shipped against
    the whole tier handed over (as before the bound)."""
    out: list[dict[str, Any]] = []
    for size in sorted({min(n, SWITCH_ADOPT_MAX), n}):
        steps = _steps(size, rng)
        for to in range(1, len(CANDIDATES)):
            row: dict[str, Any] = {"items": size, "from": CANDIDATES[0], "to": CANDIDATES[to]}
            for label, adopt_max in (("shipped", SWITCH_ADOPT_MAX), ("whole_tier", size)):
                policy = ElectPolicy(size, switch_adopt_max=adopt_max)
                _full_tier(policy, steps)
                policy._now = float(size)  # a request in flight, as when the election runs
                gc.collect()
                t0 = time.perf_counter()
                policy._switch_to(to)
                row[f"{label}_ms"] = round((time.perf_counter() - t0) * 1000, 1)
                del policy
                gc.collect()
            out.append(row)
    return out


def _median_ms(call: Any) -> float:
    times = []
    for _ in range(3):
        gc.collect()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[1] * 1000, 1)


def run_recovery_bench(
    records: list[int], wal_fraction: float, policy: str, tenants: int = 1
) -> dict[str, Any]:
    for n in records:
        if not 0 < n <= RECORDS_MAX:
            raise click.BadParameter(f"--records {n}: give 1..{RECORDS_MAX}")
    if not 0 <= wal_fraction <= 1:
        raise click.BadParameter(f"--wal-fraction {wal_fraction}: give 0..1")
    rng = np.random.default_rng(1)
    if not 1 <= tenants <= TENANTS_MAX:
        raise click.BadParameter(f"--tenants {tenants}: give 1..{TENANTS_MAX}")
    results = [_one(n, int(n * wal_fraction), policy, rng, tenants) for n in records]
    return {
        "bench": "recovery",
        "target_restart_s": 2.0,
        "results": results,
        "order_copy_ms": order_copy_ms(max(records), rng),
        "switch_ms": switch_ms(max(records), rng),
    }


def _table(report: dict[str, Any]) -> str:
    cols = [
        "records",
        "restart_s",
        "checkpoint_records",
        "wal_records",
        "load_s",
        "index_s",
        "policy_s",
        "policy",
        "tenants",
        "dropped_records",
        "restart_with_order_s",
        "order_items",
        "order_save_s",
        "lookup_ms_p99_idle",
        "lookup_ms_p99_during_order_save",
        "lookup_ms_max_during_order_save",
    ]
    lines = ["  ".join(f"{c:>18}" for c in cols)]
    lines += ["  ".join(f"{r[c]!s:>18}" for c in cols) for r in report["results"]]
    lines.append(
        "engine lock held by a save's copy, ms (whole tier / hottest "
        f"{ADOPT_ITEMS_MAX}), {report['order_copy_ms'][0]['items']} items: "
        + "  ".join(
            f"{r['policy']} {r['whole_tier_ms']}/{r['hottest_ms']}" for r in report["order_copy_ms"]
        )
    )
    lines.append(
        "engine lock held by an elect switch, ms (whole tier / as shipped): "
        + "  ".join(
            f"{r['items']} items {r['from']}->{r['to']} {r['whole_tier_ms']}/{r['shipped_ms']}"
            for r in report["switch_ms"]
        )
    )
    return "\n".join(lines)


@click.command("recovery")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--records",
    "records",
    multiple=True,
    type=int,
    default=(1_000_000,),
    show_default=True,
    help="Persistent records; repeat for several sizes.",
)
@click.option(
    "--wal-fraction",
    default=0.1,
    show_default=True,
    help="Share of the records replayed from the WAL (the rest from the checkpoint).",
)
@click.option(
    "--policy", type=click.Choice(POLICY_NAMES), default=DEFAULT_POLICY, show_default=True,
    help="Eviction policy to fill.",
)  # fmt: skip
@click.option(
    "--tenants",
    default=1,
    show_default=True,
    type=click.IntRange(1, TENANTS_MAX),
    help="Tenants the records are spread over (each its own device, extents from block 0).",
)
@click.option(
    "--sync-mib",
    default=300,
    show_default=True,
    type=click.IntRange(0, SYNC_MIB_MAX),
    help="Also measure lookup latency during a tick that fsyncs this many dirty MiB and "
    "demotes DRAM chunks (0: skip).",
)
def recovery_cmd(
    as_json: bool,
    records: tuple[int, ...],
    wal_fraction: float,
    policy: str,
    tenants: int,
    sync_mib: int,
) -> None:
    """Agent restart time from a checkpoint plus a WAL tail; lookups during fsync."""
    report = run_recovery_bench(list(records), wal_fraction, policy, tenants)
    if sync_mib:
        report["lookup_during_sync"] = run_sync_stall(sync_mib)
    text = _table(report)
    if sync_mib:
        text += "\nlookup during fsync + demotion: " + "  ".join(
            f"{k}={v}" for k, v in report["lookup_during_sync"].items()
        )
    click.echo(json.dumps(report) if as_json else text)
