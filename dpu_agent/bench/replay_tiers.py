"""`dpuctl bench replay --dram-fraction X --nvme-fraction Y`: the engine's two tiers on a trace.

The model follows the engine (docs/ENGINE.md): a tier holds a chunk at one place; a miss is
written to DRAM (placement: small chunks to the fastest tier with room), DRAM's victim is
demoted to NVMe, NVMe's victim is dropped; an NVMe hit on a block whose previous use was at most
`PROMOTE_REREAD_S` ago (the engine's hot test: a second read within 60 s) is promoted back
to DRAM, demoting DRAM's victim. Each tier has its own instance of the policy. A block hits
when it and every block before it in the request are cached in either tier.

The hits are what the replay measures. The load time is a model output: expected load time
per request = (DRAM hits x block bytes / DRAM bandwidth + NVMe hits x block bytes / NVMe
bandwidth) / requests, with both bandwidths measured in the same run through the engine's own
tier devices (AES-XTS over an anonymous mapping, and over a file whose pages are dropped from
the page cache before it is read). The report prints the model's inputs (`model_inputs`) next
to its outputs (`model_load_ms_per_request`, `model_load_vs_no_promotion`): with the same hits,
promotion's share of the load time moves with the ratio of the two bandwidths alone.
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import BLOCK_BYTES_DEFAULT, Request, distinct_blocks
from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
from dpu_agent.engine.engine import PROMOTE_REREAD_S
from dpu_agent.eviction import EvictionPolicy, make_policy

__all__ = ["format_two_tiers", "measure_tier_bandwidths", "replay_two_tiers", "two_tier_report"]

BANDWIDTH_BYTES = 64 << 20  # read per tier and round: long enough to leave the CPU caches
BANDWIDTH_CHUNK_BYTES = 4 << 20  # one read call
BANDWIDTH_ROUNDS = 3  # the median of three


class _Tiers:
    """Two policies and the block -> tier map; blocks of the request in flight stay put."""

    def __init__(self, policy: str, dram_blocks: int, nvme_blocks: int) -> None:
        self.dram = make_policy(policy, dram_blocks)
        self.nvme = make_policy(policy, max(1, nvme_blocks))  # holds nothing when 0
        self.caps = (dram_blocks, nvme_blocks)
        self.parent: dict[int, int | None] = {}  # cached blocks only
        self.last_use: dict[int, float] = {}  # cached blocks only
        self.in_flight: set[int] = set()
        self.promotions = self.demotions = 0

    def evictable(self, item: int) -> bool:
        return item not in self.in_flight

    def put_dram(self, block: int, now: float) -> bool:
        """Place `block` in DRAM, demoting DRAM's victim; False if DRAM has no evictable item."""
        if len(self.dram) >= self.caps[0]:
            victim = self.dram.victim(self.evictable)
            if victim is None:
                return False
            self.dram.remove(victim)
            self.put_nvme(victim, now)
            self.demotions += 1
        self.dram.insert(block, self.parent[block], now)
        return True

    def put_nvme(self, block: int, now: float) -> None:
        """Place `block` on NVMe, dropping NVMe's victim (or `block` itself if none)."""
        if self.caps[1] == 0:
            self._forget(block)
            return
        if len(self.nvme) >= self.caps[1]:
            victim = self.nvme.victim(self.evictable)
            if victim is None:
                self._forget(block)
                return
            self.nvme.remove(victim)
            self._forget(victim)
        self.nvme.insert(block, self.parent[block], now)

    def _forget(self, block: int) -> None:
        del self.parent[block]
        del self.last_use[block]

    def use(self, block: int, parent: int | None, now: float, promote: bool) -> None:
        if block in self.dram:
            self.dram.access(block, now)
        elif block in self.nvme:
            hot = now - self.last_use[block] <= PROMOTE_REREAD_S
            if promote and hot:
                self.nvme.remove(block)
                if self.put_dram(block, now):
                    self.promotions += 1
                else:
                    self.nvme.insert(block, self.parent[block], now)
            else:
                self.nvme.access(block, now)
        else:
            self.parent[block] = parent
            self.last_use[block] = now
            if not self.put_dram(block, now):
                self.put_nvme(block, now)
            if block not in self.parent:
                return  # stored nowhere
        self.last_use[block] = now


def _tier_of(tiers: tuple[EvictionPolicy, EvictionPolicy], block: int) -> int:
    return 0 if block in tiers[0] else 1 if block in tiers[1] else -1


def replay_two_tiers(
    trace: Sequence[Request], policy: str, dram_blocks: int, nvme_blocks: int, *, promote: bool
) -> dict[str, Any]:
    """Prefix hits per tier, promotions and demotions of one replay."""
    assert dram_blocks > 0 and nvme_blocks >= 0, (dram_blocks, nvme_blocks)
    t = _Tiers(policy, dram_blocks, nvme_blocks)
    hits = [0, 0]
    for req in trace:
        ids = req.hash_ids
        for b in ids:
            where = _tier_of((t.dram, t.nvme), b)
            if where < 0:
                break
            hits[where] += 1
        now = req.timestamp_ms / 1000.0
        t.in_flight = set(ids)
        parent: int | None = None
        for b in ids:
            t.use(b, parent, now, promote)
            parent = b
        assert len(t.dram) <= dram_blocks and len(t.nvme) <= nvme_blocks
    return {
        "dram_hits": hits[0],
        "nvme_hits": hits[1],
        "promotions": t.promotions,
        "demotions": t.demotions,
    }


def _read_gbps(dev: BlockDevice, cold: FileBlockDevice | None) -> float:
    buf = bytearray(BANDWIDTH_CHUNK_BYTES)
    step = BANDWIDTH_CHUNK_BYTES // BLOCK_SIZE
    if cold is not None:  # every round from the disk, not from pages an earlier round read
        cold.drop_cache()
    started = time.perf_counter()
    for lba in range(0, BANDWIDTH_BYTES // BLOCK_SIZE, step):
        dev.read_into(lba, memoryview(buf))
    return BANDWIDTH_BYTES / (time.perf_counter() - started) / 1e9


def measure_tier_bandwidths() -> tuple[float, float]:
    """Read GB/s of the engine's DRAM and NVMe tier devices (embedded mode), median of three."""
    blocks = BANDWIDTH_BYTES // BLOCK_SIZE
    data = secrets.token_bytes(BANDWIDTH_CHUNK_BYTES)
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        dram = MemoryBlockDevice(blocks)
        nvme = FileBlockDevice(str(Path(tmp) / "nvme.img"), blocks)
        devices: list[tuple[BlockDevice, FileBlockDevice | None]] = [
            (CryptoBlockDevice(dram, XtsCipher(secrets.token_bytes(64))), None),
            (CryptoBlockDevice(nvme, XtsCipher(secrets.token_bytes(64))), nvme),
        ]
        out = []
        for dev, cold in devices:
            step = BANDWIDTH_CHUNK_BYTES // BLOCK_SIZE
            for lba in range(0, blocks, step):
                dev.write(lba, memoryview(data))
            dev.flush()
            out.append(statistics.median(_read_gbps(dev, cold) for _ in range(BANDWIDTH_ROUNDS)))
            dev.close()
    return out[0], out[1]


def two_tier_report(
    trace: Sequence[Request],
    policy: str,
    dram_fraction: float,
    nvme_fraction: float,
    *,
    block_bytes: int = BLOCK_BYTES_DEFAULT,
    bandwidths_gbps: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Hits per tier and expected load time per request, with and without promotion."""
    if not 0.0 < dram_fraction <= 1.0 or not 0.0 <= nvme_fraction <= 1.0:
        raise ValueError(
            f"--dram-fraction must be in (0, 1] and --nvme-fraction in [0, 1], got "
            f"{dram_fraction} and {nvme_fraction}"
        )
    if block_bytes <= 0:
        raise ValueError(f"block bytes must be positive, got {block_bytes}")
    distinct = distinct_blocks(trace)
    dram_blocks = max(1, round(dram_fraction * distinct))
    nvme_blocks = round(nvme_fraction * distinct)
    dram_gbps, nvme_gbps = bandwidths_gbps or measure_tier_bandwidths()
    accesses = sum(len(r.hash_ids) for r in trace)
    rows = []
    for promote in (True, False):
        r = replay_two_tiers(trace, policy, dram_blocks, nvme_blocks, promote=promote)
        load_s = (r["dram_hits"] / (dram_gbps * 1e9) + r["nvme_hits"] / (nvme_gbps * 1e9)) * (
            block_bytes / len(trace)
        )
        rows.append(
            {
                "promotion": promote,
                **r,
                "dram_hit_rate": r["dram_hits"] / accesses,
                "nvme_hit_rate": r["nvme_hits"] / accesses,
                "hit_rate": (r["dram_hits"] + r["nvme_hits"]) / accesses,
                "model_load_ms_per_request": load_s * 1e3,
            }
        )
    base = rows[1]["model_load_ms_per_request"]
    for row in rows:
        ratio = row["model_load_ms_per_request"] / base if base else None
        row["model_load_vs_no_promotion"] = ratio
    return {
        "policy": policy,
        "dram_fraction": dram_fraction,
        "nvme_fraction": nvme_fraction,
        "dram_blocks": dram_blocks,
        "nvme_blocks": nvme_blocks,
        "model": MODEL,
        "model_inputs": {
            "block_bytes": block_bytes,
            "dram_gbps": dram_gbps,
            "nvme_gbps": nvme_gbps,
            "bandwidths": "measured in this run" if bandwidths_gbps is None else "given",
        },
        "results": rows,
    }


MODEL = (
    "model_load_ms_per_request = (dram_hits x block_bytes / dram_gbps + nvme_hits x "
    "block_bytes / nvme_gbps) / requests: an output of the measured hits and model_inputs"
)


def format_two_tiers(report: dict[str, Any]) -> str:
    inputs = report["model_inputs"]
    lines = [
        f"DRAM {report['dram_blocks']} blocks, NVMe {report['nvme_blocks']} blocks, "
        f"policy {report['policy']}",
        f"model inputs ({inputs['bandwidths']}): DRAM {inputs['dram_gbps']:.2f} GB/s, NVMe "
        f"{inputs['nvme_gbps']:.2f} GB/s, {inputs['block_bytes']} B per block",
        "promotion | DRAM hits | NVMe hits | total | promotions | demotions | model load "
        "ms/request | model vs no promotion",
    ]
    for r in report["results"]:
        ratio = r["model_load_vs_no_promotion"]
        lines.append(
            f"{'on' if r['promotion'] else 'off'} | {r['dram_hit_rate'] * 100:.2f}% | "
            f"{r['nvme_hit_rate'] * 100:.2f}% | {r['hit_rate'] * 100:.2f}% | {r['promotions']} | "
            f"{r['demotions']} | {r['model_load_ms_per_request']:.2f} | "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'}"
        )
    return "\n".join(lines)
