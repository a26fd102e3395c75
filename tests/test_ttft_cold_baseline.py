"""The TTFT benchmark's cold baseline is the fastest prefill measured, not the chunk-sized one
(the first tables compared the tier with 64-token blocks, 1.4-1.6x slower than 256-token ones,
and overstated the speedup). A stand-in engine with fixed timings, so no model is needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra (torch)")
import torch

from dpu_agent.bench.ttft import COLD_BLOCKS, _measure
from kvproto.keys import ChunkLayout


@dataclass
class _Result:
    logits: torch.Tensor
    timings_s: dict[str, float]
    cached_tokens: int = 0


@dataclass
class _Engine:
    """prefill() of a prompt: cold takes `cold_s[block]`, warm 0.1 s; logits differ by
    `rounding` except in chunk-sized blocks (as float32 prefills of other shapes do)."""

    cold_s: dict[int, float]
    rounding: float = 2e-5
    layout: ChunkLayout = field(
        default_factory=lambda: ChunkLayout(
            model_id="m",
            dtype="float32",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            chunk_tokens=64,
        )
    )
    calls: list[Any] = field(default_factory=list)

    def prefill(self, prompt: list[int], *, use_tier: bool = True, block_tokens: Any = None) -> Any:
        self.calls.append((use_tier, block_tokens))
        logits = torch.zeros(8)
        if use_tier:
            return _Result(logits, {"total_s": 0.1, "forward_s": 0.09, "get_s": 0.01}, 1984)
        key = 0 if block_tokens == len(prompt) else block_tokens
        if key != self.layout.chunk_tokens:
            logits = logits + self.rounding
        return _Result(logits, {"total_s": self.cold_s[key]})


def test_ttft_cold_baseline_is_the_fastest_prefill() -> None:
    engine = _Engine({64: 3.0, 256: 2.0, 512: 2.2, 0: 2.5})
    _, row = _measure(engine, list(range(2048)), repeats=2)
    assert row["cold_block_tokens"] == 256 and row["cold_ttft_s"] == 2.0
    assert row["speedup"] == 20.0 and row["speedup_vs_chunk_blocks"] == 30.0
    assert row["max_abs_logit_diff"] == 0.0  # warm vs cold in chunk-sized blocks
    assert row["max_abs_logit_diff_fastest"] == pytest.approx(2e-5)
    tried = {b for tier, b in engine.calls if not tier}
    assert tried == {64, 256, 512, 2048}  # every block size, and the whole prompt at once
    assert sorted(COLD_BLOCKS) == [0, 256, 512]


def test_ttft_whole_prompt_counts_when_it_is_fastest() -> None:
    engine = _Engine({64: 3.0, 256: 2.0, 512: 2.2, 0: 1.0})
    _, row = _measure(engine, list(range(2048)), repeats=1)
    assert row["cold_block_tokens"] == 2048 and row["speedup"] == 10.0
