"""LMCache remote-storage plugin for the tier: LMCache keeps its chunks on the DPU agent.

Tested with LMCache 0.5.6 (CPU torch). LMCache's plugin framework loads the class named in
its config and asks it for a connector of ``plugin://dpukv``; the agent's address comes from
``extra_config``::

    chunk_size: 256
    remote_serde: "naive"
    remote_storage_plugins: ["dpukv"]
    extra_config:
      remote_storage_plugin.dpukv.module_path: host_shim.integrations.lmcache
      remote_storage_plugin.dpukv.class_name: DpuKVConnectorAdapter
      dpukv.control: "tcp://10.0.0.2:7400"           # the agent's control address
      dpukv.tenant: acme
      dpukv.token_file: /etc/dpukv/acme.token
      dpukv.salt_file: /etc/dpukv/acme.salt          # hex

(The deprecated ``remote_url: "dpukv://10.0.0.2:7400/acme"`` without the plugin list works
too; giving both makes LMCache build two remote backends, so give one.)

LMCache names chunks itself (`CacheEngineKey`, its own prefix hash over the tokens, with the
model, worker and dtype in it) and hands the connector opaque keys, not tokens, so this
connector stores each LMCache object under ``BLAKE2b-128(key=salt, data=key.to_string())`` as
one tier object holding LMCache's bytes as they are (no header, no copy: the agent's NVMe/TCP
reads and writes go straight to and from LMCache's memory object). The object's shape follows
from its length and LMCache's metadata, as for LMCache's own remote connectors
(`object_shape`). Batches of objects go through one call of KVClient's key-level API
(`lookup_lengths`, `get_keys`, `put_keys`): one lookup, reads and writes spread over the I/O
queues, checksums verified, as for token-keyed chunks.

`DpuKVConnectorAdapter` and `DpuKVRemoteConnector` live in `_lmcache_connector` (which imports
LMCache) and are imported on first access, so this module imports without LMCache.
"""

from __future__ import annotations

from typing import Any

# The parts that need no LMCache, re-exported as they are (`_lmcache_core.__all__`).
from host_shim.integrations._lmcache_core import *  # noqa: F403
from host_shim.integrations._lmcache_core import __all__ as __all__


def __getattr__(name: str) -> Any:
    """The LMCache classes on first access: only then is LMCache imported."""
    if name in ("DpuKVConnectorAdapter", "DpuKVRemoteConnector"):
        from host_shim.integrations import _lmcache_connector

        return getattr(_lmcache_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
