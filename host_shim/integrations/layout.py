"""KV layout conversions between inference engines and the tier's chunks (torch, no engine).

A tier chunk is one tensor of `ChunkLayout.chunk_shape` =
``(num_layers, 2, num_kv_heads, chunk_tokens, head_dim)``: the K (index 0) and V (index 1) of
`chunk_tokens` consecutive tokens, all layers. Engines keep KV differently:

- Hugging Face transformers: per layer ``keys``/``values`` of ``[batch=1, heads, tokens, dim]``
  (`per_layer_to_chunks`, `chunks_to_per_layer`).
- vLLM: paged, per layer one tensor of blocks of `block_size` tokens, with the block table of a
  request naming its blocks in token order (`PagedLayout`, `gather_chunk`, `scatter_chunk`).

Every conversion here is a copy with no arithmetic, so a round trip is byte-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvproto.keys import ChunkLayout

__all__ = [
    "PAGED_KINDS",
    "PagedLayout",
    "chunk_block_ids",
    "chunks_to_per_layer",
    "gather_chunk",
    "per_layer_to_chunks",
    "scatter_chunk",
    "torch_dtype",
]

PagedKind = Literal["flash_attn", "flashinfer_nhd", "flashinfer_hnd"]
# Per-layer paged tensor shapes of vLLM's attention backends, in their own words:
# FlashAttention `get_kv_cache_shape` -> (2, num_blocks, block_size, num_kv_heads, head_size);
# FlashInfer -> (num_blocks, 2, block_size, num_kv_heads, head_size), stored NHD or, with the
# HND cache layout, (num_blocks, 2, num_kv_heads, block_size, head_size).
PAGED_KINDS: tuple[PagedKind, ...] = ("flash_attn", "flashinfer_nhd", "flashinfer_hnd")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a ChunkLayout names ('float16', 'torch.bfloat16', ...)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"layout dtype {name!r} is not a torch dtype")
    return dtype


# --- transformers: per-layer [1, heads, tokens, dim] ---------------------------------------


def per_layer_to_chunks(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    layout: ChunkLayout,
    *,
    first: int = 0,
    count: int | None = None,
) -> list[torch.Tensor]:
    """Chunks `first .. first+count-1` of a per-layer cache, each a new CPU tensor.

    `keys[l]`, `values[l]`: ``[1, num_kv_heads, tokens, head_dim]``; only full chunks exist.
    """
    assert len(keys) == len(values) == layout.num_layers, (len(keys), layout.num_layers)
    n = layout.chunk_tokens
    total = keys[0].shape[-2] // n
    count = total - first if count is None else count
    assert 0 <= first and first + count <= total, (first, count, total)
    out = []
    for i in range(first, first + count):
        span = slice(i * n, (i + 1) * n)
        chunk = torch.stack(
            [torch.stack((k[0, :, span], v[0, :, span])) for k, v in zip(keys, values, strict=True)]
        )
        assert chunk.shape == layout.chunk_shape, (chunk.shape, layout.chunk_shape)
        out.append(chunk.to("cpu", copy=False).contiguous())
    return out


def chunks_to_per_layer(
    chunks: torch.Tensor, layout: ChunkLayout
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(count, *chunk_shape)`` -> per layer (K, V) of ``[1, heads, count*chunk_tokens, dim]``."""
    assert chunks.shape[1:] == layout.chunk_shape, (chunks.shape, layout.chunk_shape)
    count, layers, _, heads, n, dim = chunks.shape
    # (count, L, 2, H, n, D) -> (L, 2, H, count, n, D) -> tokens in order along one axis.
    joined = chunks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, count * n, dim)
    return [(joined[i, 0].unsqueeze(0), joined[i, 1].unsqueeze(0)) for i in range(layers)]


# --- vLLM: paged blocks --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedLayout:
    """How one vLLM attention layer's paged KV tensor is laid out."""

    kind: PagedKind = "flash_attn"
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kind not in PAGED_KINDS:
            raise ValueError(f"paged layout kind {self.kind!r}; use one of {PAGED_KINDS}")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")

    def shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The per-layer tensor shape vLLM allocates for this layout."""
        b, h, d = self.block_size, num_kv_heads, head_dim
        if self.kind == "flash_attn":
            return (2, num_blocks, b, h, d)
        if self.kind == "flashinfer_nhd":
            return (num_blocks, 2, b, h, d)
        return (num_blocks, 2, h, b, d)

    def standard(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """A view (no copy) of ``[2, num_blocks, block_size, heads, dim]`` over `kv_layer`."""
        assert kv_layer.dim() == 5, kv_layer.shape
        if self.kind == "flash_attn":
            view = kv_layer
        elif self.kind == "flashinfer_nhd":
            view = kv_layer.permute(1, 0, 2, 3, 4)
        else:
            view = kv_layer.permute(1, 0, 3, 2, 4)
        assert view.shape[0] == 2 and view.shape[2] == self.block_size, (self, kv_layer.shape)
        return view


def chunk_block_ids(
    block_ids: Sequence[int], chunk_index: int, chunk_tokens: int, block_size: int
) -> list[int]:
    """The blocks of a request's block table that hold chunk `chunk_index`, in token order."""
    if chunk_tokens % block_size:
        raise ValueError(
            f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's block_size={block_size}; "
            "pick a chunk size that is (256 works for block sizes 16, 32, 64, 128, 256)"
        )
    per = chunk_tokens // block_size
    ids = list(block_ids[chunk_index * per : (chunk_index + 1) * per])
    assert len(ids) == per, (
        f"block table of {len(block_ids)} blocks ends inside chunk {chunk_index}"
    )
    return ids


def gather_chunk(
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    chunk_index: int,
    layout: ChunkLayout,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy chunk `chunk_index` of a request out of vLLM's paged layers into a tier chunk."""
    assert len(kv_layers) == layout.num_layers, (len(kv_layers), layout.num_layers)
    ids = chunk_block_ids(block_ids, chunk_index, layout.chunk_tokens, paged.block_size)
    n = layout.chunk_tokens
    if out is None:
        out = torch.empty(layout.chunk_shape, dtype=kv_layers[0].dtype)
    assert out.shape == layout.chunk_shape, (out.shape, layout.chunk_shape)
    index = torch.tensor(ids, dtype=torch.long, device=kv_layers[0].device)
    for layer, kv in enumerate(kv_layers):
        blocks = paged.standard(kv).index_select(1, index)  # [2, nb, bs, H, D]
        tokens = blocks.reshape(2, n, layout.num_kv_heads, layout.head_dim)
        out[layer].copy_(tokens.permute(0, 2, 1, 3))  # [2, H, n, D]
    return out


def scatter_chunk(
    chunk: torch.Tensor,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    chunk_index: int,
    layout: ChunkLayout,
) -> None:
    """Write a tier chunk into a request's blocks of vLLM's paged layers (in place)."""
    assert chunk.shape == layout.chunk_shape, (chunk.shape, layout.chunk_shape)
    assert len(kv_layers) == layout.num_layers, (len(kv_layers), layout.num_layers)
    ids = chunk_block_ids(block_ids, chunk_index, layout.chunk_tokens, paged.block_size)
    nb, bs = len(ids), paged.block_size
    index = torch.tensor(ids, dtype=torch.long, device=kv_layers[0].device)
    for layer, kv in enumerate(kv_layers):
        src = chunk[layer].to(kv.device, non_blocking=True)  # [2, H, n, D]
        blocks = src.permute(0, 2, 1, 3).reshape(2, nb, bs, layout.num_kv_heads, layout.head_dim)
        paged.standard(kv).index_copy_(1, index, blocks)
