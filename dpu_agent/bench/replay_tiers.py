"""`dpuctl bench replay --dram-fraction X --nvme-fraction Y`: the engine's two tiers on a trace.

The replay goes through the real Engine (`replay_engine.replay_engine` with a DRAM tier): its
placement (a chunk to DRAM while DRAM has room, else to NVMe), its demotion of DRAM's victims
and its promotion of NVMe chunks read twice within PROMOTE_REREAD_S, both in the tick the
replay runs every 0.5 s of the trace's time as the agent does. The baseline, in the same run:
the same trace through an engine with the NVMe tier alone, as large as the two tiers together.

The hits are what the replay measures. The load time is a model output: expected load time
per request = (DRAM hits x block bytes / DRAM bandwidth + NVMe hits x block bytes / NVMe
bandwidth) / requests, with both bandwidths measured in the same run through the engine's own
tier devices (AES-XTS over an anonymous mapping, and over a file whose pages are dropped from
the page cache before it is read). The report prints the model's inputs (`model_inputs`) next
to its outputs (`model_load_ms_per_request`, `model_load_vs_nvme_only`): with the same hits,
what DRAM saves moves with the ratio of the two bandwidths alone.
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
from dpu_agent.bench.replay_engine import replay_engine
from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher

__all__ = ["format_two_tiers", "measure_tier_bandwidths", "two_tier_report"]

BANDWIDTH_BYTES = 64 << 20  # read per tier and round: long enough to leave the CPU caches
BANDWIDTH_CHUNK_BYTES = 4 << 20  # one read call
BANDWIDTH_ROUNDS = 3  # the median of three


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
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """Hits per tier through the engine and expected load time per request, against the NVMe
    tier alone with the same total capacity."""
    if not 0.0 < dram_fraction <= 1.0 or not 0.0 < nvme_fraction <= 1.0:
        raise ValueError(
            f"--dram-fraction and --nvme-fraction must be in (0, 1] (the engine always has an "
            f"NVMe tier), got {dram_fraction} and {nvme_fraction}"
        )
    if block_bytes <= 0:
        raise ValueError(f"block bytes must be positive, got {block_bytes}")
    distinct = distinct_blocks(trace)
    dram_blocks = max(1, round(dram_fraction * distinct))
    nvme_blocks = max(1, round(nvme_fraction * distinct))
    dram_gbps, nvme_gbps = bandwidths_gbps or measure_tier_bandwidths()
    accesses = sum(len(r.hash_ids) for r in trace)
    rows: list[dict[str, Any]] = []
    for layout, dram, nvme in (
        ("dram+nvme", dram_blocks, nvme_blocks),
        ("nvme-only", 0, dram_blocks + nvme_blocks),
    ):
        r = replay_engine(trace, policy, nvme, dram_blocks=dram, data_dir=data_dir)
        dram_hits, nvme_hits = r.hits_by_tier.get("dram", 0), r.hits_by_tier.get("nvme", 0)
        load_s = (dram_hits / (dram_gbps * 1e9) + nvme_hits / (nvme_gbps * 1e9)) * (
            block_bytes / len(trace)
        )
        rows.append(
            {
                "layout": layout,
                "dram_blocks": dram,
                "nvme_blocks": nvme,
                "dram_hits": dram_hits,
                "nvme_hits": nvme_hits,
                "promotions": r.promotions,
                "demotions": r.demotions,
                "dram_hit_rate": dram_hits / accesses,
                "nvme_hit_rate": nvme_hits / accesses,
                "hit_rate": r.hits / accesses,
                "model_load_ms_per_request": load_s * 1e3,
            }
        )
    base = rows[1]["model_load_ms_per_request"]
    for row in rows:
        row["model_load_vs_nvme_only"] = row["model_load_ms_per_request"] / base if base else None
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
        f"policy {report['policy']}, through the engine",
        f"model inputs ({inputs['bandwidths']}): DRAM {inputs['dram_gbps']:.2f} GB/s, NVMe "
        f"{inputs['nvme_gbps']:.2f} GB/s, {inputs['block_bytes']} B per block",
        "layout | DRAM hits | NVMe hits | total | promotions | demotions | model load "
        "ms/request | model vs NVMe only",
    ]
    for r in report["results"]:
        ratio = r["model_load_vs_nvme_only"]
        lines.append(
            f"{r['layout']} | {r['dram_hit_rate'] * 100:.2f}% | "
            f"{r['nvme_hit_rate'] * 100:.2f}% | {r['hit_rate'] * 100:.2f}% | {r['promotions']} | "
            f"{r['demotions']} | {r['model_load_ms_per_request']:.2f} | "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'}"
        )
    return "\n".join(lines)
