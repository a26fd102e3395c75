"""LMCache adapter and remote connector for the tier (imports LMCache; see .lmcache).

Written against LMCache 0.5.6's `lmcache.v1.storage_backend.connector`: `ConnectorAdapter`
with `can_parse(url)` and `create_connector(context: ConnectorContext)`, and `RemoteConnector`
(whose ``__init__(config, metadata)`` derives the full chunk's shape, dtype and format) with
async `exists`, `get`, `put`, `batched_get`, `batched_put`, `batched_async_contains`,
`batched_get_non_blocking`, `list`, `close` and sync `exists_sync`, `batched_contains`.
LMCache wraps the connector in `InstrumentedRemoteConnector`, which drops each memory object's
reference after `put`/`batched_put`: this connector never does. Blocking tier calls run in the
default executor so LMCache's event loop keeps running.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from host_shim.client import KVClient
from host_shim.integrations._lmcache_core import (
    PLUGIN,
    SCHEME,
    KeyedChunks,
    agent_address,
    object_shape,
    tier_key,
)
from host_shim.integrations.credentials import load_credentials, parse_salt
from kvproto.keys import ChunkLayout

__all__ = ["DpuKVConnectorAdapter", "DpuKVRemoteConnector"]

IO_QUEUES_DEFAULT = 4  # NVMe/TCP queues per connector (extra_config dpukv.io_queues)
TIMEOUT_S_DEFAULT = 5.0  # per agent call (dpukv.timeout_s): a slower agent is a miss


def _secret(extra: dict[str, Any], name: str) -> str:
    if extra.get(f"dpukv.{name}"):
        return str(extra[f"dpukv.{name}"])
    path = extra.get(f"dpukv.{name}_file")
    if not path:
        raise ValueError(f"LMCache extra_config needs dpukv.{name} or dpukv.{name}_file")
    return Path(str(path)).read_text().strip()


class DpuKVRemoteConnector(RemoteConnector):
    """LMCache objects as tier objects on the agent (one per LMCache key)."""

    def __init__(self, url: str, context: ConnectorContext) -> None:
        if context.config is None or context.metadata is None:
            raise ValueError("the dpukv connector needs LMCache's config and metadata")
        super().__init__(context.config, context.metadata)
        if len(self.meta_shapes) != 1:
            raise ValueError(
                f"LMCache KV of {len(self.meta_shapes)} layer groups; the dpukv connector "
                "stores single-group KV only"
            )
        extra = dict(context.config.extra_config or {})
        tls: ssl.SSLContext | None = None
        if extra.get("dpukv.credentials_file"):  # `dpuctl hosts enrol`'s file
            creds = load_credentials(str(extra["dpukv.credentials_file"]))
            tls = creds.tls_context()
            extra.update({
                "dpukv.control": creds.client_url,  # every URL: a cluster's seeds
                "dpukv.tenant": creds.tenant,
                "dpukv.token": creds.token,
                "dpukv.salt": creds.salt.hex(),
            })  # fmt: skip
        control, tenant = agent_address(url, extra)
        self._salt = parse_salt(_secret(extra, "salt"))
        # The layout only binds token keys, which this connector does not use; it names the
        # objects' owner for the agent's accounting.
        layout = ChunkLayout(
            model_id="lmcache", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1
        )
        queues = int(extra.get("dpukv.io_queues", IO_QUEUES_DEFAULT))
        timeout_s = float(extra.get("dpukv.timeout_s", TIMEOUT_S_DEFAULT))
        deadline = extra.get("dpukv.node_deadline_s")  # a cluster's per-node deadline
        self._client = KVClient(
            control, tenant, _secret(extra, "token"), layout, self._salt,
            io_queues=queues, timeout_s=timeout_s,
            node_deadline_s=float(deadline) if deadline else None, ssl_context=tls,
        )  # fmt: skip
        self._objects = KeyedChunks(self._client)
        self.loop = context.loop
        self.local_cpu_backend = context.local_cpu_backend

    def _keys(self, keys: list[Any]) -> list[bytes]:
        return [tier_key(self._salt, k.to_string()) for k in keys]

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # --- reads ----------------------------------------------------------------------------
    def _read(self, keys: list[Any]) -> list[Any]:
        """The leading objects of `keys` the tier holds, in memory objects LMCache allocated;
        those that could not be allocated or read are not returned (their references dropped)."""
        tier = self._keys(keys)
        objs: list[Any] = []
        for length in self._objects.lengths(tier):
            shape = object_shape(self.meta_shapes[0], self.full_chunk_size_bytes, length)
            if shape is None:
                break  # not an object of this model's layout
            obj = self.local_cpu_backend.allocate(
                torch.Size(shape), self.meta_dtypes[0], self.meta_fmt
            )
            if obj is None:
                break  # LMCache's CPU buffer is full: a shorter hit
            objs.append(obj)
        read = self._objects.read_into(tier[: len(objs)], [o.byte_array for o in objs])
        for obj in objs[read:]:
            obj.ref_count_down()
        return objs[:read]

    async def get(self, key: Any) -> Any:
        objs = await self._run(self._read, [key])
        return objs[0] if objs else None

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        objs = await self._run(self._read, list(keys))
        return objs + [None] * (len(keys) - len(objs))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        return list(await self._run(self._read, list(keys)))

    # --- writes ---------------------------------------------------------------------------
    def _write(self, keys: list[Any], objs: list[Any]) -> int:
        return self._objects.write(self._keys(keys), [o.byte_array for o in objs], None)

    async def put(self, key: Any, memory_obj: Any) -> None:
        # InstrumentedRemoteConnector drops memory_obj's reference when this returns.
        await self._run(self._write, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        # InstrumentedRemoteConnector drops every object's reference when this returns.
        await self._run(self._write, list(keys), list(memory_objs))

    # --- lookups --------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return bool(await self._run(self._objects.count, self._keys([key])))

    def exists_sync(self, key: Any) -> bool:
        return self._objects.count(self._keys([key])) > 0

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self._objects.count(self._keys(list(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return int(await self._run(self._objects.count, self._keys(list(keys))))

    async def list(self) -> list[str]:
        return []  # the agent does not list keys to tenants (keys are salted hashes anyway)

    async def close(self) -> None:
        await self._run(self._client.close)


class DpuKVConnectorAdapter(ConnectorAdapter):
    """Builds DpuKVRemoteConnector for ``plugin://dpukv`` (the plugin path: the agent's
    address in extra_config) and ``dpukv://HOST:PORT/TENANT`` (LMCache's remote_url)."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith("plugin://"):
            return url[len("plugin://") :].split(".", 1)[0] == PLUGIN
        return url.startswith(SCHEME)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return DpuKVRemoteConnector(context.url, context)
