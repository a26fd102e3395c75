"""Prefix reuse for Hugging Face transformers models through the tier.

After a prefill, every full chunk of the prompt (chunk i = tokens ``[i*n, (i+1)*n)``, all layers,
K and V) goes to the tier as one buffer of `ChunkLayout.chunk_shape`. Before the next prefill the
longest cached prefix is loaded into a `transformers.DynamicCache` and only the rest of the
prompt runs through the model; at least the last prompt token always does, so the next-token
logits come out of a real forward. Positions follow from the cache length (this transformers
release derives `position_ids` from ``cache.get_seq_length()``).

Prefill runs in blocks aligned to chunk boundaries, with or without the tier. A float32 forward
of the same token over a different number of query rows rounds differently (the CPU attention
and matmul kernels pick their blocking by shape), so a one-shot prefill and a prefix-plus-rest
prefill differ by about 2e-5 in the logits. Aligned blocks make the warm path run exactly the
operations the cold path runs after the cached prefix, and the logits are bit-identical.

    engine = TieredModel(model, client)
    out = engine.prefill(tokens)               # lookup + get + partial prefill
    engine.store(tokens, out.cache)            # put the prompt's full chunks
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from host_shim.gpu import staging_device
from host_shim.integrations.layout import (
    chunks_to_per_layer,
    per_layer_to_chunks,
    torch_dtype,
)
from kvproto.keys import ChunkLayout

__all__ = [
    "ChunkStore",
    "PrefillResult",
    "TieredModel",
    "cache_tensors",
    "model_layout",
]

log = logging.getLogger("host_shim.integrations.transformers")


class ChunkStore(Protocol):
    """What TieredModel needs of host_shim.client.KVClient."""

    layout: ChunkLayout

    def lookup(self, tokens: Sequence[int]) -> int: ...

    def get(self, tokens: Sequence[int], into: Sequence[Any]) -> int: ...

    def put(self, tokens: Sequence[int], chunks: Sequence[Any]) -> int: ...


def model_layout(
    config: Any, *, model_id: str, dtype: torch.dtype, chunk_tokens: int = 256, tp_rank: int = 0
) -> ChunkLayout:
    """The chunk layout of a decoder model from its transformers config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return ChunkLayout(
        model_id=model_id,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=text.num_hidden_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tp_rank=tp_rank,
        chunk_tokens=chunk_tokens,
    )


def cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values (``[1, heads, tokens, dim]``) of a DynamicCache."""
    keys, values = [], []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer), type(layer)
        assert layer.keys is not None and layer.values is not None, "uninitialised layer"
        keys.append(layer.keys)
        values.append(layer.values)
    return keys, values


@dataclass(slots=True, kw_only=True)
class PrefillResult:
    logits: torch.Tensor  # next-token logits, [vocab]
    cache: DynamicCache  # KV of every prompt token
    prompt_tokens: int
    cached_tokens: int  # tokens whose KV came from the tier
    timings_s: dict[str, float] = field(default_factory=dict)


class TieredModel:
    """A causal LM whose prefills reuse prompt prefixes stored in the tier.

    `client` is a `host_shim.client.KVClient` (or anything with its lookup/get/put) whose layout
    matches the model (`model_layout`). `client=None` runs the same prefill with no tier.
    """

    def __init__(self, model: Any, client: ChunkStore | None, *, layout: ChunkLayout) -> None:
        self.model = model
        self.client = client
        self.layout = layout
        self.dtype = torch_dtype(layout.dtype)
        self.device = next(model.parameters()).device
        if client is not None:
            assert client.layout == layout, (client.layout, layout)

    # --- the two paths --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], *, use_tier: bool = True, block_tokens: int | None = None
    ) -> PrefillResult:
        """Next-token logits of `tokens`, loading the cached prefix first when `use_tier`.

        The prefill runs in blocks ending on multiples of `block_tokens` (default: the chunk
        size, which keeps cold and warm logits bit-identical; a larger block is a faster cold
        prefill whose logits differ from the warm ones by float32 rounding)."""
        assert len(tokens) >= 1, "empty prompt"
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        cached = 0
        cache = DynamicCache(config=self.model.config)
        if use_tier and self.client is not None:
            cache, cached = self._load(tokens, timings)
        t1 = time.perf_counter()
        logits = self._forward_blocks(tokens, cache, cached, block_tokens)
        t2 = time.perf_counter()
        timings["forward_s"] = t2 - t1
        timings["total_s"] = t2 - t0
        return PrefillResult(
            logits=logits,
            cache=cache,
            prompt_tokens=len(tokens),
            cached_tokens=cached,
            timings_s=timings,
        )

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Make `cache` (which holds a prefix of `tokens`) hold all of `tokens`, as a prefill.

        For scripted conversations (a fixed reply appended after a prompt): the partial last
        chunk is cropped and recomputed with the new tokens, so every full chunk's KV is exactly
        what a later cold prefill of the same tokens computes. Returns the last-token logits.
        """
        have = cache.get_seq_length()
        assert have <= len(tokens), (have, len(tokens))
        aligned = have // self.layout.chunk_tokens * self.layout.chunk_tokens
        if have > aligned:
            cache.crop(aligned - have)  # negative: tokens to remove from the end
        return self._forward_blocks(tokens, cache, aligned)

    @torch.inference_mode()
    def store(self, tokens: Sequence[int], cache: DynamicCache) -> int:
        """Put the full chunks of `tokens` whose KV `cache` holds; returns chunks the tier holds."""
        assert self.client is not None, "store() needs a client"
        n = self.layout.chunk_tokens
        count = min(len(tokens), cache.get_seq_length()) // n
        if count == 0:
            return 0
        keys, values = cache_tensors(cache)
        chunks = per_layer_to_chunks(keys, values, self.layout, count=count)
        return self.client.put(list(tokens[: count * n]), chunks)

    # --- internals ------------------------------------------------------------------------
    def _load(self, tokens: Sequence[int], timings: dict[str, float]) -> tuple[DynamicCache, int]:
        """The longest cached prefix as a DynamicCache, leaving at least one token to run."""
        assert self.client is not None
        n = self.layout.chunk_tokens
        t0 = time.perf_counter()
        hits = min(self.client.lookup(list(tokens)), (len(tokens) - 1) // n)
        t1 = time.perf_counter()
        timings["lookup_s"] = t1 - t0
        if hits == 0:
            return DynamicCache(config=self.model.config), 0
        device = staging_device(self.client, self.device)  # NIXL: the GPU itself, no staging
        buf = torch.empty((hits, *self.layout.chunk_shape), dtype=self.dtype, device=device)
        loaded = self.client.get(list(tokens[: hits * n]), list(buf.unbind(0)))
        t2 = time.perf_counter()
        timings["get_s"] = t2 - t1
        if loaded == 0:
            return DynamicCache(config=self.model.config), 0
        per_layer = chunks_to_per_layer(buf[:loaded], self.layout)
        data = [(k.to(self.device), v.to(self.device)) for k, v in per_layer]
        cache = DynamicCache(data, config=self.model.config)
        timings["to_cache_s"] = time.perf_counter() - t2
        return cache, loaded * n

    def _forward_blocks(
        self, tokens: Sequence[int], cache: DynamicCache, start: int, block: int | None = None
    ) -> Any:
        """Forward `tokens[start:]` in blocks that end on multiples of `block` (default the
        chunk size); last-token logits."""
        n = block or self.layout.chunk_tokens
        assert n >= 1, n
        assert start % self.layout.chunk_tokens == 0, f"prefill starts at {start}, mid-chunk"
        assert cache.get_seq_length() == start, (cache.get_seq_length(), start)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        logits = None
        pos = start
        while pos < len(tokens):
            end = min((pos // n + 1) * n, len(tokens))
            out = self.model(
                input_ids=ids[:, pos:end], cache=cache, use_cache=True, logits_to_keep=1
            )
            logits = out.logits
            pos = end
        assert logits is not None, "nothing to forward"
        return logits[0, -1].float()
