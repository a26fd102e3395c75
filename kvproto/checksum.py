"""Chunk checksums: xxh3-128 over the chunk key then the plaintext, computed by the writer and
verified on every read (DESIGN.md, Integrity).

Hashing the key too binds the bytes to the name they were stored under, so a chunk served for
the wrong key (a stale extent, a misdirected read) fails verification like a corrupted one.
xxh3-128 runs at about 18 GB/s here (docs/MEASURED.md), far above the data path; it is a
corruption check, not a MAC (the XTS encryption and tenant isolation handle adversaries).
"""

from __future__ import annotations

import hmac
from typing import Any

import numpy as np
import xxhash

from kvproto.keys import KEY_BYTES

__all__ = ["CHECKSUM_BYTES", "chunk_checksum", "verify_checksum"]

CHECKSUM_BYTES = 16


def _byte_view(data: Any) -> memoryview:
    """A zero-copy, C-contiguous byte view of bytes, bytearray, memoryview or a numpy array."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError(
                f"chunk data must be C-contiguous (shape {data.shape}, strides {data.strides}); "
                "pass np.ascontiguousarray(data)"
            )
        # view(uint8) also covers dtypes the buffer protocol cannot export (e.g. bfloat16).
        return data.reshape(-1).view(np.uint8).data
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("chunk data must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def chunk_checksum(key: bytes, data: Any) -> bytes:
    """16 bytes: xxh3-128 of `key` (16 bytes) followed by the plaintext bytes of `data`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(_byte_view(data))
    return h.digest()


def verify_checksum(key: bytes, data: Any, expected: bytes) -> bool:
    """True when `data` under `key` hashes to `expected`; a mismatch means miss + quarantine."""
    if len(expected) != CHECKSUM_BYTES:
        raise ValueError(f"expected checksum must be {CHECKSUM_BYTES} bytes, got {len(expected)}")
    return hmac.compare_digest(chunk_checksum(key, data), expected)
