"""`DpuKVConnector`: the vLLM V1 connector class (imports vLLM; see host_shim.integrations.vllm).

Written against vLLM's ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/v1/
base.py): ``__init__(vllm_config, role, kv_cache_config)``; scheduler side
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``; worker side ``register_kv_caches``, ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from host_shim.client import KVClient
from host_shim.integrations.layout import PagedLayout
from host_shim.integrations.vllm import (
    ConnectorSettings,
    ReqLoad,
    ReqStore,
    load_request,
    matched_tokens,
    save_request,
    storable_chunks,
)
from kvproto.keys import ChunkLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["DpuKVConnector", "DpuKVConnectorMetadata"]


@dataclass
class DpuKVConnectorMetadata(KVConnectorMetadata):
    loads: list[ReqLoad] = field(default_factory=list)
    stores: list[ReqStore] = field(default_factory=list)


def _layout(vllm_config: VllmConfig, chunk_tokens: int, tp_rank: int) -> ChunkLayout:
    """The same layout on the scheduler and every worker: from the model config."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = mc.dtype if cache_dtype in (None, "auto") else getattr(torch, str(cache_dtype))
    return ChunkLayout(
        model_id=str(mc.model),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        tp_rank=tp_rank,
        chunk_tokens=chunk_tokens,
    )


class DpuKVConnector(KVConnectorBase_V1):
    """KV chunks of prompt prefixes in the DPU tier (load before the forward, save after)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._settings = ConnectorSettings.from_extra_config(extra)
        self._block_size = vllm_config.cache_config.block_size
        self._paged = PagedLayout(kind=self._settings.paged_kind, block_size=self._block_size)  # type: ignore[arg-type]
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self._layout = _layout(vllm_config, self._settings.chunk_tokens, tp_rank)
        s = self._settings
        self._client = KVClient(s.control, s.tenant, s.token, self._layout, s.salt,
                                transport=s.transport)  # fmt: skip
        self._pending_loads: dict[str, ReqLoad] = {}
        self._local_tokens: dict[str, int] = {}
        self._tracked: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self._layers: list[torch.Tensor] = []

    # --- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        if len(tokens) <= self._layout.chunk_tokens:
            return 0, False
        hits = self._client.lookup(tokens)
        self._local_tokens[request.request_id] = num_computed_tokens  # vLLM's own prefix hit
        n = self._layout.chunk_tokens
        return matched_tokens(hits, len(tokens), num_computed_tokens, n), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        n = self._layout.chunk_tokens
        computed = self._local_tokens.pop(request.request_id, 0)
        self._pending_loads[request.request_id] = ReqLoad(
            req_id=request.request_id,
            token_ids=tuple(request.prompt_token_ids or ()),
            block_ids=tuple(blocks.get_block_ids()[0]),
            first_chunk=computed // n,
            chunk_count=(computed + num_external_tokens) // n - computed // n,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = DpuKVConnectorMetadata()
        n = self._layout.chunk_tokens
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(
                    ReqLoad(
                        req_id=load.req_id,
                        token_ids=load.token_ids,
                        block_ids=tuple(new.block_ids[0]),
                        first_chunk=load.first_chunk,
                        chunk_count=load.chunk_count,
                    )
                )
            self._tracked[new.req_id] = (tuple(new.prompt_token_ids or ()), list(new.block_ids[0]))
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._add_store(meta, new.req_id, done, n)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._tracked:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                self._tracked[req_id][1].extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._add_store(meta, req_id, done, n)
        return meta

    def _add_store(self, meta: DpuKVConnectorMetadata, req_id: str, done: int, n: int) -> None:
        tokens, block_ids = self._tracked[req_id]
        count = storable_chunks(done, len(tokens), n)
        if count:
            meta.stores.append(
                ReqStore(
                    req_id=req_id, token_ids=tokens, block_ids=tuple(block_ids), chunk_count=count
                )
            )
        if done >= len(tokens):
            del self._tracked[req_id]  # prompt fully computed: its chunks are stored this step

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._tracked.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._local_tokens.pop(request.request_id, None)
        return False, None

    # --- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())  # insertion order is layer order
        assert len(self._layers) == self._layout.num_layers, (len(self._layers), self._layout)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DpuKVConnectorMetadata)
        for load in meta.loads:
            load_request(self._client, self._layers, self._paged, self._layout, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer (a chunk spans all layers)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DpuKVConnectorMetadata)
        for store in meta.stores:
            save_request(self._client, self._layers, self._paged, self._layout, store)

    def shutdown(self) -> None:
        self._client.close()
