"""Chunk checksums: xxh3-128 over key then plaintext, zero-copy over any buffer."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvproto.checksum import chunk_checksum, verify_checksum

KEY = bytes(range(16))


def test_matches_xxh3_128_of_key_then_data() -> None:
    data = bytes(range(256)) * 16
    assert chunk_checksum(KEY, data) == xxhash.xxh3_128(KEY + data).digest()
    assert len(chunk_checksum(KEY, data)) == 16


def test_buffer_types_agree() -> None:
    arr = np.arange(4096, dtype=np.float16).reshape(2, 2048)
    raw = arr.tobytes()
    expected = chunk_checksum(KEY, raw)
    assert chunk_checksum(KEY, arr) == expected
    assert chunk_checksum(KEY, bytearray(raw)) == expected
    assert chunk_checksum(KEY, memoryview(raw)) == expected
    assert chunk_checksum(KEY, arr.data) == expected


def test_flipped_bit_changes_checksum() -> None:
    data = bytearray(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8).tobytes())
    good = chunk_checksum(KEY, data)
    assert verify_checksum(KEY, data, good)
    data[12345] ^= 0x10
    assert chunk_checksum(KEY, data) != good
    assert not verify_checksum(KEY, data, good)


def test_key_is_part_of_checksum() -> None:
    data = b"x" * 4096
    assert chunk_checksum(KEY, data) != chunk_checksum(bytes(16), data)


def test_non_contiguous_array_rejected() -> None:
    arr = np.zeros((64, 64), dtype=np.float32)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        chunk_checksum(KEY, arr)


def test_bad_key_length_rejected() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        chunk_checksum(b"short", b"")
