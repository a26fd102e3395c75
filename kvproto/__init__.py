"""kvproto: wire formats both the agent and the host shim speak (sans-I/O, no sockets).

Chunk keys, checksums, control-plane frames and NVMe/TCP PDUs. Depends only on the host
shim's own dependencies (msgpack, xxhash, numpy).
"""

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use: kvproto.control (the CLI's, every command's) needs no numpy.
_WHERE = {
    "CHECKSUM_BYTES": "kvproto.checksum",
    "chunk_checksum": "kvproto.checksum",
    "verify_checksum": "kvproto.checksum",
    "KEY_BYTES": "kvproto.keys",
    "LAYOUT_ID_BYTES": "kvproto.keys",
    "ChunkLayout": "kvproto.keys",
    "chunk_keys": "kvproto.keys",
}

if TYPE_CHECKING:
    from kvproto.checksum import CHECKSUM_BYTES, chunk_checksum, verify_checksum
    from kvproto.keys import KEY_BYTES, LAYOUT_ID_BYTES, ChunkLayout, chunk_keys


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvproto' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


__all__ = [
    "CHECKSUM_BYTES",
    "KEY_BYTES",
    "LAYOUT_ID_BYTES",
    "ChunkLayout",
    "chunk_checksum",
    "chunk_keys",
    "verify_checksum",
]
