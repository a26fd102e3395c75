"""KV layout conversions between inference engines and the tier's chunks (torch, no engine).

A tier chunk is one tensor of `ChunkLayout.chunk_shape` =
``(num_layers, 2, num_kv_heads, chunk_tokens, head_dim)``: the K (index 0) and V (index 1) of
`chunk_tokens` consecutive tokens, all layers. Engines keep KV differently:

- Hugging Face transformers: per layer ``keys``/``values`` of ``[batch=1, heads, tokens, dim]``
  (`per_layer_to_chunks`, `chunks_to_per_layer`).
- vLLM: paged, per layer one tensor of blocks of `block_size` tokens, with the block table of a
  request naming its blocks in token order (`PagedLayout`, `gather_chunks`, `scatter_chunks`).

Every conversion here is a copy with no arithmetic, so a round trip is byte-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvproto.keys import ChunkLayout

__all__ = [
    "BACKEND_KINDS",
    "PAGED_KINDS",
    "PagedLayout",
    "check_chunk_tokens",
    "chunk_block_ids",
    "chunks_to_per_layer",
    "gather_chunk",
    "gather_chunks",
    "per_layer_to_chunks",
    "scatter_chunk",
    "scatter_chunks",
    "torch_dtype",
]

PagedKind = Literal["cpu", "flash_attn", "flash_attn_5d", "flashinfer_nhd", "flashinfer_hnd"]
# Per-layer paged KV tensors of vLLM's attention backends (B blocks, N tokens per block, H kv
# heads, D head size), in their own words:
# - "cpu": vLLM >= 0.2x CPU backend (cpu_attn.py), ``[B, H, N, 2*D]`` whose memory per (block,
#   head) is the N key rows then the N value rows (it views it as ``[B, H, 2*N, D]`` and splits
#   dim 2 in halves): NOT K and V side by side per token.
# - "flash_attn": vLLM >= 0.2x FlashAttention, Triton and FlexAttention, the logical
#   ``[B, H, N, 2*D]`` with K = ``[..., :D]`` and V = ``[..., D:]`` of each token (any stride
#   order: only the logical view is indexed).
# - "flash_attn_5d": older vLLM FlashAttention ``(2, B, N, H, D)``.
# - "flashinfer_nhd" / "flashinfer_hnd": older FlashInfer ``(B, 2, N, H, D)`` /
#   ``(B, 2, H, N, D)``.
PAGED_KINDS: tuple[PagedKind, ...] = (
    "cpu",
    "flash_attn",
    "flash_attn_5d",
    "flashinfer_nhd",
    "flashinfer_hnd",
)
# vLLM attention backend name (`AttentionBackend.get_name()`) -> the 4-D layout it keeps.
BACKEND_KINDS: dict[str, PagedKind] = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "flash_attn",
    "TRITON_ATTN": "flash_attn",
    "FLEX_ATTENTION": "flash_attn",
}


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
    """How one vLLM attention layer's paged KV tensor is laid out (`PAGED_KINDS`)."""

    kind: PagedKind = "flash_attn"
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kind not in PAGED_KINDS:
            raise ValueError(f"paged layout kind {self.kind!r}; use one of {PAGED_KINDS}")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")

    @property
    def block_dim(self) -> int:
        """The dimension that indexes blocks: gathers and scatters run along it."""
        return 1 if self.kind == "flash_attn_5d" else 0

    def shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The per-layer tensor shape vLLM allocates for this layout."""
        b, n, h, d = num_blocks, self.block_size, num_kv_heads, head_dim
        if self.kind in ("cpu", "flash_attn"):
            return (b, h, n, 2 * d)
        if self.kind == "flash_attn_5d":
            return (2, b, n, h, d)
        if self.kind == "flashinfer_nhd":
            return (b, 2, n, h, d)
        return (b, 2, h, n, d)

    def check(self, kv_layer: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        """ValueError, naming both shapes, when `kv_layer` is not a tensor of this layout."""
        shape = tuple(kv_layer.shape)
        blocks = shape[self.block_dim] if len(shape) > self.block_dim else 0
        want = self.shape(blocks, num_kv_heads, head_dim)
        if shape != want:
            raise ValueError(
                f"vLLM's KV tensor has shape {list(shape)}; the {self.kind!r} layout with "
                f"block_size={self.block_size}, {num_kv_heads} kv heads of {head_dim} is "
                f"{list(want)}: "
                f"set kv_connector_extra_config.paged_layout to one of {PAGED_KINDS}"
            )

    def standard(self, blocks: torch.Tensor) -> torch.Tensor:
        """A ``[2, H, k, block_size, D]`` view (no copy) of `blocks`: k contiguous blocks of
        this layout (what `index_select` on `block_dim` returns)."""
        n = self.block_size
        if self.kind in ("cpu", "flash_attn"):
            assert blocks.dim() == 4 and blocks.is_contiguous(), blocks.shape
            k, h, _, d2 = blocks.shape
            if self.kind == "cpu":  # per (block, head): N key rows, then N value rows
                return blocks.view(k, h, 2, n, d2 // 2).permute(2, 1, 0, 3, 4)
            return blocks.view(k, h, n, 2, d2 // 2).permute(3, 1, 0, 2, 4)
        assert blocks.dim() == 5, blocks.shape
        if self.kind == "flash_attn_5d":
            return blocks.permute(0, 3, 1, 2, 4)
        if self.kind == "flashinfer_nhd":
            return blocks.permute(1, 3, 0, 2, 4)
        return blocks.permute(1, 2, 0, 3, 4)


def chunk_block_ids(
    block_ids: Sequence[int], chunk_index: int, chunk_tokens: int, block_size: int
) -> list[int]:
    """The blocks of a request's block table that hold chunk `chunk_index`, in token order."""
    check_chunk_tokens(chunk_tokens, block_size)
    per = chunk_tokens // block_size
    ids = list(block_ids[chunk_index * per : (chunk_index + 1) * per])
    assert len(ids) == per, (
        f"block table of {len(block_ids)} blocks ends inside chunk {chunk_index}"
    )
    return ids


def check_chunk_tokens(chunk_tokens: int, block_size: int) -> None:
    """ValueError unless a chunk covers whole vLLM blocks."""
    if chunk_tokens % block_size:
        raise ValueError(
            f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's block_size={block_size}; "
            f"pick a chunk size that is (e.g. {block_size * max(1, 256 // block_size)}), or "
            "set vLLM's block_size to a divisor of chunk_tokens"
        )


def _chunk_index(
    paged: PagedLayout, block_ids: Sequence[int], first: int, count: int, layout: ChunkLayout,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    ids = [
        b
        for i in range(first, first + count)
        for b in chunk_block_ids(block_ids, i, layout.chunk_tokens, paged.block_size)
    ]
    return torch.tensor(ids, dtype=torch.long, device=device)


def gather_chunks(
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    first: int,
    count: int,
    layout: ChunkLayout,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks `first .. first+count-1` of a request out of vLLM's paged layers, as one CPU
    tensor ``(count, *chunk_shape)``: per layer one gather along the block dimension, then one
    strided copy into the chunks."""
    assert len(kv_layers) == layout.num_layers, (len(kv_layers), layout.num_layers)
    shape = (count, *layout.chunk_shape)
    if out is None:
        out = torch.empty(shape, dtype=kv_layers[0].dtype)
    assert tuple(out.shape) == shape, (out.shape, shape)
    if count == 0:
        return out
    index = _chunk_index(paged, block_ids, first, count, layout, kv_layers[0].device)
    h, d, n = layout.num_kv_heads, layout.head_dim, paged.block_size
    per = layout.chunk_tokens // n
    for layer, kv in enumerate(kv_layers):
        blocks = kv.index_select(paged.block_dim, index)  # contiguous: count*per blocks
        src = paged.standard(blocks).reshape(2, h, count, per, n, d)
        dst = out[:, layer].view(count, 2, h, per, n, d).permute(1, 2, 0, 3, 4, 5)
        dst.copy_(src)
    return out


def scatter_chunks(
    chunks: torch.Tensor,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    first: int,
    layout: ChunkLayout,
) -> None:
    """Write ``chunks`` (``(count, *chunk_shape)``, chunks `first ..` of a request) into the
    request's blocks of vLLM's paged layers, in place: per layer one strided copy into a
    block-shaped buffer, then one scatter along the block dimension."""
    count = chunks.shape[0]
    assert tuple(chunks.shape[1:]) == layout.chunk_shape, (chunks.shape, layout.chunk_shape)
    assert len(kv_layers) == layout.num_layers, (len(kv_layers), layout.num_layers)
    if count == 0:
        return
    index = _chunk_index(paged, block_ids, first, count, layout, kv_layers[0].device)
    h, d, n = layout.num_kv_heads, layout.head_dim, paged.block_size
    per = layout.chunk_tokens // n
    for layer, kv in enumerate(kv_layers):
        blocks = torch.empty(paged.shape(count * per, h, d), dtype=kv.dtype, device=kv.device)
        dst = paged.standard(blocks).view(2, h, count, per, n, d)
        dst.copy_(chunks[:, layer].view(count, 2, h, per, n, d).permute(1, 2, 0, 3, 4, 5))
        kv.index_copy_(paged.block_dim, index, blocks)


def gather_chunk(
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    chunk_index: int,
    layout: ChunkLayout,
) -> torch.Tensor:
    """Chunk `chunk_index` of a request out of vLLM's paged layers (`gather_chunks` of one)."""
    return gather_chunks(kv_layers, paged, block_ids, chunk_index, 1, layout)[0]


def scatter_chunk(
    chunk: torch.Tensor,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    block_ids: Sequence[int],
    chunk_index: int,
    layout: ChunkLayout,
) -> None:
    """Write one tier chunk into a request's blocks of vLLM's paged layers (in place)."""
    scatter_chunks(chunk.unsqueeze(0), kv_layers, paged, block_ids, chunk_index, layout)
