"""Inference-engine integrations of the tier: each module imports its engine only when used.

- `host_shim.integrations.layout`: conversions between engine KV layouts and tier chunks
  (per-layer ``[batch, heads, tokens, head_dim]`` caches, vLLM paged blocks), torch only.
- `host_shim.integrations.transformers`: prefix reuse for Hugging Face transformers models
  (store the prompt's chunks after a prefill, load the longest cached prefix before the next).
- `host_shim.integrations.vllm`: a vLLM V1 KV connector (``KVConnectorBase_V1``).
- `host_shim.integrations.lmcache`: an LMCache remote-storage plugin that points LMCache at the
  agent.

This package needs torch (the ``[inference]`` extra); the rest of host_shim does not. Nothing is
imported here so that importing one integration never pulls in another engine.
"""

__all__: list[str] = []
