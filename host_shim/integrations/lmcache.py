"""LMCache remote-storage plugin for the tier: LMCache keeps its chunks on the DPU agent.

LMCache (v0.3.x/0.4.x "Remote Storage Plugin Framework") loads a `ConnectorAdapter` named in its
config, and the adapter builds a `RemoteConnector` for URLs of its scheme::

    chunk_size: 256
    remote_url: "dpukv://10.0.0.2:7400/acme"        # agent control address / tenant
    remote_serde: "naive"
    remote_storage_plugins: ["dpukv"]
    extra_config:
      remote_storage_plugin.dpukv.module_path: host_shim.integrations.lmcache
      remote_storage_plugin.dpukv.class_name: DpuKVConnectorAdapter
      dpukv.token_file: /etc/dpukv/acme.token
      dpukv.salt_file: /etc/dpukv/acme.salt          # hex

LMCache names chunks itself (`CacheEngineKey`, its own prefix hash over the tokens) and hands
the connector opaque keys, not tokens, so this connector stores each LMCache object under
``BLAKE2b-128(key=salt, data=key.to_string())`` as one tier object: a small header (shape,
dtype, memory format, payload length) followed by LMCache's bytes. Objects are written with
the same reserve / write / commit (checksum) and read with the same lookup (lease) / read /
verify / release as `KVClient`'s chunks, through `KeyedChunks` over KVClient's key-level calls
(`lookup_keys`, `lookup_lengths`, `get_keys`, `put_keys`).

`DpuKVConnectorAdapter` and `DpuKVRemoteConnector` live in `_lmcache_connector` (which imports
LMCache) and are imported on first access, so this module imports without LMCache.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgpack

from host_shim.client import KVClient
from kvproto.keys import KEY_BYTES

__all__ = [
    "HEADER_BYTES_MAX",
    "KeyedChunks",
    "pack_object",
    "parse_dpukv_url",
    "tier_key",
    "unpack_object",
]

SCHEME = "dpukv://"
HEADER_BYTES_MAX = 4096  # shape, dtype and format names: a few dozen bytes in practice
_HEADER_LEN = struct.Struct("<I")
_PERSON = b"dpukv-lmcache-v1"  # BLAKE2b personalization (<= 16 bytes): LMCache keys only


def tier_key(salt: bytes, lmcache_key: str) -> bytes:
    """The 16-byte tier key of an LMCache key string, salted per tenant like chunk keys."""
    h = hashlib.blake2b(lmcache_key.encode(), digest_size=KEY_BYTES, key=salt, person=_PERSON)
    return h.digest()


def parse_dpukv_url(url: str) -> tuple[str, str]:
    """'dpukv://host:port/tenant' -> ('tcp://host:port', tenant)."""
    parts = urlsplit(url)
    tenant = parts.path.strip("/")
    if parts.scheme != "dpukv" or not parts.hostname or parts.port is None or not tenant:
        raise ValueError(f"LMCache remote_url {url!r}: use dpukv://HOST:PORT/TENANT")
    return f"tcp://{parts.hostname}:{parts.port}", tenant


def pack_object(shape: Sequence[int], dtype: str, fmt: int, payload: bytes | memoryview) -> bytes:
    """Header (u32 length + msgpack map) then the payload bytes."""
    header = msgpack.packb(
        {"shape": [int(d) for d in shape], "dtype": dtype, "fmt": int(fmt), "n": len(payload)}
    )
    assert len(header) <= HEADER_BYTES_MAX, len(header)
    return _HEADER_LEN.pack(len(header)) + header + bytes(payload)


def unpack_object(data: bytes | memoryview) -> tuple[list[int], str, int, memoryview]:
    """(shape, dtype, fmt, payload) of a packed object; ValueError if it is not one."""
    view = memoryview(data)
    if len(view) < _HEADER_LEN.size:
        raise ValueError(f"object of {len(view)} bytes has no header")
    (hlen,) = _HEADER_LEN.unpack_from(view)
    if hlen > HEADER_BYTES_MAX or _HEADER_LEN.size + hlen > len(view):
        raise ValueError(f"header length {hlen} does not fit an object of {len(view)} bytes")
    header = msgpack.unpackb(
        view[_HEADER_LEN.size : _HEADER_LEN.size + hlen], raw=False, strict_map_key=True
    )
    payload = view[_HEADER_LEN.size + hlen :]
    if not isinstance(header, dict) or header.get("n") != len(payload):
        raise ValueError("object header does not match its payload")
    return list(header["shape"]), str(header["dtype"]), int(header["fmt"]), payload


class KeyedChunks:
    """Objects by 16-byte key, through KVClient's key-level calls.

    The same reserve, write, commit-with-checksum and lookup, read, verify, release as its
    token-keyed calls; each object is one chunk of its own length. A lost agent is a miss
    (False / None), as for KVClient.
    """

    def __init__(self, client: KVClient) -> None:
        self.client = client

    def exists(self, key: bytes) -> bool:
        return self.client.lookup_keys([key]) > 0

    def read(self, key: bytes) -> bytes | None:
        lengths = self.client.lookup_lengths([key])
        if not lengths:
            return None
        buf = bytearray(lengths[0])
        # replaced by an object of another length in between: a miss, like any other
        if not self.client.get_keys([key], [buf], chunk_bytes=len(buf)):
            return None
        return bytes(buf)

    def write(self, key: bytes, data: bytes) -> bool:
        """Store `data` under `key`; True when the tier holds it (an object already stored
        under the key is kept: LMCache keys name their content)."""
        return self.client.put_keys([key], [data], [None], chunk_bytes=len(data)) > 0


def __getattr__(name: str) -> Any:
    """The LMCache classes on first access: only then is LMCache imported."""
    if name in ("DpuKVConnectorAdapter", "DpuKVRemoteConnector"):
        from host_shim.integrations import _lmcache_connector

        return getattr(_lmcache_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
