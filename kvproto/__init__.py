"""kvproto: wire formats both the agent and the host shim speak (sans-I/O, no sockets).

Chunk keys, checksums, control-plane frames and NVMe/TCP PDUs. Depends only on the host
shim's own dependencies (msgpack, xxhash, numpy).
"""

from typing import TYPE_CHECKING

from kvproto._lazy import lazy_exports

if TYPE_CHECKING:
    from kvproto.checksum import CHECKSUM_BYTES, chunk_checksum, verify_checksum
    from kvproto.keys import KEY_BYTES, LAYOUT_ID_BYTES, ChunkLayout, chunk_keys


# Imported on first use: kvproto.control (the CLI's, every command's) needs no numpy.
__getattr__ = lazy_exports(
    __name__,
    {
        "kvproto.checksum": ("CHECKSUM_BYTES", "chunk_checksum", "verify_checksum"),
        "kvproto.keys": ("KEY_BYTES", "LAYOUT_ID_BYTES", "ChunkLayout", "chunk_keys"),
    },
)


__all__ = [
    "CHECKSUM_BYTES",
    "KEY_BYTES",
    "LAYOUT_ID_BYTES",
    "ChunkLayout",
    "chunk_checksum",
    "chunk_keys",
    "verify_checksum",
]
