"""vLLM V1 KV connector for the tier: what it does, and the parts that need no vLLM.

vLLM loads the connector by name from this module::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "DpuKVConnector",
        "kv_connector_module_path": "host_shim.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"control": "tcp://10.0.0.2:7400", "tenant": "acme",
            "token_file": "/etc/dpukv/acme.token", "salt_file": "/etc/dpukv/acme.salt",
            "chunk_tokens": 256, "paged_layout": "flash_attn"}}'

`DpuKVConnector` (a `KVConnectorBase_V1`, in `_vllm_connector`, imported on first access so
that this module and its layout code import without vLLM) works like this:

- scheduler side: `get_num_new_matched_tokens` asks the agent for the longest cached prefix of
  the prompt (full chunks, leaving at least the last prompt token to compute) beyond what vLLM
  already has; `update_state_after_alloc` remembers the blocks vLLM allocated for those tokens;
  `build_connector_meta` hands the worker one `ReqLoad` per request to load and one `ReqStore`
  per request whose prompt chunks are computed in this step;
- worker side: `start_load_kv` gets the chunks from the agent into host buffers and scatters
  them into the request's paged blocks of every layer (`load_request`); `wait_for_save`
  gathers the computed chunks out of the paged blocks and puts them (`save_request`).
  A chunk spans all layers, so loads complete before the forward and saves after it
  (`wait_for_layer_load` and `save_kv_layer` have nothing to do per layer).

Chunk boundaries must fall on block boundaries: `chunk_tokens` a multiple of vLLM's block size.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from host_shim.gpu import staging_device
from host_shim.integrations.layout import (
    PagedLayout,
    gather_chunk,
    scatter_chunk,
    torch_dtype,
)
from kvproto.keys import ChunkLayout

__all__ = [
    "ConnectorSettings",
    "ReqLoad",
    "ReqStore",
    "load_request",
    "matched_tokens",
    "save_request",
    "storable_chunks",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    """`kv_connector_extra_config` of the connector, validated."""

    control: str
    tenant: str
    token: str
    salt: bytes
    chunk_tokens: int = 256
    paged_kind: str = "flash_attn"
    transport: str = "nvme-tcp"  # or "nixl" / "auto": KVClient's data path (host_shim.transport)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        def secret(name: str) -> str:
            if extra.get(name):
                return str(extra[name])
            path = extra.get(f"{name}_file")
            if not path:
                raise ValueError(f"kv_connector_extra_config needs {name!r} or {name + '_file'!r}")
            return Path(str(path)).read_text().strip()

        for name in ("control", "tenant"):
            if not extra.get(name):
                raise ValueError(f"kv_connector_extra_config needs {name!r}")
        salt_hex = secret("salt")
        try:
            salt = binascii.unhexlify(salt_hex)
        except binascii.Error:
            raise ValueError("the salt must be hex (32 to 128 hex digits)") from None
        return cls(
            control=str(extra["control"]),
            tenant=str(extra["tenant"]),
            token=secret("token"),
            salt=salt,
            chunk_tokens=int(extra.get("chunk_tokens", 256)),
            paged_kind=str(extra.get("paged_layout", "flash_attn")),
            transport=str(extra.get("transport", "nvme-tcp")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReqLoad:
    """Load chunks ``[first_chunk, first_chunk + chunk_count)`` of a request into its blocks."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_chunk: int
    chunk_count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReqStore:
    """Store the first `chunk_count` chunks of a request out of its blocks."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    chunk_count: int


def matched_tokens(
    hit_chunks: int, prompt_tokens: int, num_computed_tokens: int, chunk_tokens: int
) -> int:
    """Tokens the tier adds beyond vLLM's own prefix cache (get_num_new_matched_tokens)."""
    usable = min(hit_chunks, (prompt_tokens - 1) // chunk_tokens)  # keep one token to compute
    return max(0, usable * chunk_tokens - num_computed_tokens)


def storable_chunks(computed_tokens: int, prompt_tokens: int, chunk_tokens: int) -> int:
    """Full prompt chunks whose KV exists after `computed_tokens` tokens were computed."""
    return min(computed_tokens, prompt_tokens) // chunk_tokens


def load_request(
    client: Any,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    layout: ChunkLayout,
    req: ReqLoad,
) -> int:
    """Get the request's chunks from the tier into its paged blocks; chunks loaded (leading)."""
    n = layout.chunk_tokens
    end = req.first_chunk + req.chunk_count
    device = staging_device(client, kv_layers[0].device)  # NIXL: the GPU itself, no staging
    bufs = torch.empty((end, *layout.chunk_shape), dtype=torch_dtype(layout.dtype), device=device)
    # get() loads from chunk 0: chunks before first_chunk are vLLM's own and not written back.
    loaded = int(client.get(list(req.token_ids[: end * n]), list(bufs.unbind(0))))
    for i in range(req.first_chunk, loaded):
        scatter_chunk(bufs[i], kv_layers, paged, req.block_ids, i, layout)
    return max(0, loaded - req.first_chunk)


def save_request(
    client: Any,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    layout: ChunkLayout,
    req: ReqStore,
) -> int:
    """Gather the request's full chunks out of its paged blocks and put them; chunks held."""
    if req.chunk_count == 0:
        return 0
    n = layout.chunk_tokens
    device = staging_device(client, kv_layers[0].device)  # NIXL: the GPU itself, no staging
    chunks = [
        gather_chunk(kv_layers, paged, req.block_ids, i, layout).to(device)
        for i in range(req.chunk_count)
    ]
    return int(client.put(list(req.token_ids[: req.chunk_count * n]), chunks))


def __getattr__(name: str) -> Any:
    """`DpuKVConnector` on first access: only then is vLLM imported."""
    if name == "DpuKVConnector":
        from host_shim.integrations._vllm_connector import DpuKVConnector

        return DpuKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
