"""LMCache adapter and remote connector for the tier (imports LMCache; see .lmcache).

Written against LMCache's `lmcache.v1.storage_backend.connector`: `ConnectorAdapter(schema)`
with `create_connector(context: ConnectorContext)`, and `RemoteConnector` with async `exists`,
`get`, `put`, `list`, `close` and `exists_sync`. Blocking tier calls run in the default
executor so LMCache's event loop keeps running.
"""

from __future__ import annotations

import asyncio
import binascii
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from host_shim.client import KVClient
from host_shim.integrations.lmcache import (
    SCHEME,
    KeyedChunks,
    pack_object,
    parse_dpukv_url,
    tier_key,
    unpack_object,
)
from kvproto.keys import ChunkLayout

__all__ = ["DpuKVConnectorAdapter", "DpuKVRemoteConnector"]


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
        control, tenant = parse_dpukv_url(url)
        extra = dict((context.config.extra_config or {}) if context.config else {})
        self._salt = binascii.unhexlify(_secret(extra, "salt"))
        # The layout only binds token keys, which this connector does not use; it names the
        # objects' owner for the agent's accounting.
        layout = ChunkLayout(
            model_id="lmcache", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1
        )
        self._client = KVClient(control, tenant, _secret(extra, "token"), layout, self._salt)
        self._objects = KeyedChunks(self._client)
        self.loop = context.loop
        self.local_cpu_backend = context.local_cpu_backend

    def _key(self, key: Any) -> bytes:
        return tier_key(self._salt, key.to_string())

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def exists(self, key: Any) -> bool:
        return bool(await self._run(self._objects.exists, self._key(key)))

    def exists_sync(self, key: Any) -> bool:
        return self._objects.exists(self._key(key))

    async def get(self, key: Any) -> Any:
        data = await self._run(self._objects.read, self._key(key))
        if data is None:
            return None
        shape, dtype, fmt, payload = unpack_object(data)
        memory_obj = self.local_cpu_backend.allocate(
            torch.Size(shape), getattr(torch, dtype), MemoryFormat(fmt)
        )
        if memory_obj is None:
            return None
        view = memoryview(memory_obj.byte_array).cast("B")
        view[: len(payload)] = payload
        return memory_obj

    async def put(self, key: Any, memory_obj: Any) -> None:
        data = pack_object(
            list(memory_obj.get_shape()),
            str(memory_obj.get_dtype()).removeprefix("torch."),
            int(memory_obj.get_memory_format().value),
            memoryview(memory_obj.byte_array).cast("B"),
        )
        try:
            await self._run(self._objects.write, self._key(key), data)
        finally:
            memory_obj.ref_count_down()

    async def list(self) -> list[str]:
        return []  # the agent does not list keys to tenants (keys are salted hashes anyway)

    async def close(self) -> None:
        await self._run(self._client.close)


class DpuKVConnectorAdapter(ConnectorAdapter):
    """Builds DpuKVRemoteConnector for ``dpukv://HOST:PORT/TENANT`` URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return DpuKVRemoteConnector(context.url, context)
