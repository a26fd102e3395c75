"""Chunk keys: chained, salted prefix hashes that name a chunk of KV cache and its whole prefix.

`key[i] = BLAKE2b-128(key=salt, data=layout_id || key[i-1] || tokens[i*n:(i+1)*n] as <u4)`,
with 16 zero bytes standing for `key[-1]`. The tenant's secret salt is BLAKE2b's *key*
parameter (keyed-hash mode, a MAC) rather than a prefix of the input: BLAKE2b is designed for
that, it costs nothing extra, and without the salt nobody can compute (and so probe for) another
tenant's keys. Chaining makes equal prefixes give equal keys and a key name its whole prefix.
Everything is explicit bytes (no Python `hash`), so keys are equal across processes and machines.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where tokens are hashed: the key sizes need none of it
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "CHUNK_KEYS_TOKENS_MAX",
    "DTYPE_ITEMSIZE",
    "KEY_BYTES",
    "LAYOUT_ID_BYTES",
    "SALT_BYTES_MAX",
    "SALT_BYTES_MIN",
    "ChunkLayout",
    "chunk_keys",
]

KEY_BYTES = 16
LAYOUT_ID_BYTES = 16
# A salt is a secret: 128 bits at least; BLAKE2b's key parameter takes 64 bytes at most.
SALT_BYTES_MIN = 16
SALT_BYTES_MAX = 64
# 16 Mi tokens: far above any context window in use (1 Mi tokens), small enough that a
# runaway caller fails fast instead of hashing gigabytes.
CHUNK_KEYS_TOKENS_MAX = 1 << 24
TOKEN_MAX = (1 << 32) - 1  # tokens travel as little-endian uint32

# Bytes per element of the dtype names inference engines use (torch names, with or without
# the "torch." prefix, which is dropped so both spell the same layout).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

# Field limits: generous for any real model, tight enough that a corrupted or hostile layout
# cannot ask for petabyte-sized chunks.
_MODEL_ID_BYTES_MAX = 256
_NUM_LAYERS_MAX = 1024
_NUM_KV_HEADS_MAX = 1024
_HEAD_DIM_MAX = 4096
_TP_RANK_MAX = 1023
_CHUNK_TOKENS_MAX = 65536

_LAYOUT_PERSON = b"dpukv-layout-v1"  # BLAKE2b personalization: domain separation, <= 16 bytes
_LAYOUT_INTS = struct.Struct("<IIIII")  # num_layers, num_kv_heads, head_dim, tp_rank, chunk_tokens
_ZERO_KEY = bytes(KEY_BYTES)


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ChunkLayout.{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"ChunkLayout.{name}={value} is outside [{low}, {high}]")


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Shape of one chunk of one model's KV cache, and the id that keys are bound to.

    Two deployments whose KV tensors differ in any field (model, dtype, shape, tensor-parallel
    rank, chunk size) get different `layout_id`s, so they never read each other's chunks.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"ChunkLayout.model_id must be a non-empty str, got {self.model_id!r}")
        if len(self.model_id.encode()) > _MODEL_ID_BYTES_MAX:
            raise ValueError(f"ChunkLayout.model_id is longer than {_MODEL_ID_BYTES_MAX} bytes")
        if not isinstance(self.dtype, str):
            raise TypeError(f"ChunkLayout.dtype must be a str, got {type(self.dtype).__name__}")
        dtype = self.dtype.removeprefix("torch.")
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"ChunkLayout.dtype={self.dtype!r} is unknown; use one of {sorted(DTYPE_ITEMSIZE)}"
            )
        object.__setattr__(self, "dtype", dtype)
        _check_int("num_layers", self.num_layers, 1, _NUM_LAYERS_MAX)
        _check_int("num_kv_heads", self.num_kv_heads, 1, _NUM_KV_HEADS_MAX)
        _check_int("head_dim", self.head_dim, 1, _HEAD_DIM_MAX)
        _check_int("tp_rank", self.tp_rank, 0, _TP_RANK_MAX)
        _check_int("chunk_tokens", self.chunk_tokens, 1, _CHUNK_TOKENS_MAX)

    def canonical_bytes(self) -> bytes:
        """The unambiguous encoding `layout_id` hashes: length-prefixed strings, then <u4 ints."""
        model, dtype = self.model_id.encode(), self.dtype.encode()
        return b"".join(
            (
                struct.pack("<H", len(model)),
                model,
                struct.pack("<H", len(dtype)),
                dtype,
                _LAYOUT_INTS.pack(
                    self.num_layers,
                    self.num_kv_heads,
                    self.head_dim,
                    self.tp_rank,
                    self.chunk_tokens,
                ),
            )
        )

    @property
    def layout_id(self) -> bytes:
        """16 bytes: BLAKE2b-128 (personalised) of `canonical_bytes()`."""
        h = hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=_LAYOUT_PERSON)
        return h.digest()

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2 (K and V), num_kv_heads, chunk_tokens, head_dim)."""
        return (self.num_layers, 2, self.num_kv_heads, self.chunk_tokens, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def chunk_bytes(self) -> int:
        n = self.itemsize
        for dim in self.chunk_shape:
            n *= dim
        return n


def _tokens_u32(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.uint32]:
    """Tokens as a contiguous little-endian uint32 array; ValueError on anything else."""
    import numpy as np

    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size > CHUNK_KEYS_TOKENS_MAX:
        raise ValueError(f"{arr.size} tokens exceed CHUNK_KEYS_TOKENS_MAX={CHUNK_KEYS_TOKENS_MAX}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > TOKEN_MAX:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside [0, {TOKEN_MAX}] (tokens are uint32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_keys(
    tokens: Sequence[int] | npt.NDArray[np.integer],
    *,
    salt: bytes,
    layout_id: bytes,
    chunk_tokens: int = 256,
) -> list[bytes]:
    """One 16-byte key per *full* chunk of `chunk_tokens` tokens; a partial tail gets none."""
    if not isinstance(salt, bytes | bytearray) or not (
        SALT_BYTES_MIN <= len(salt) <= SALT_BYTES_MAX
    ):
        size = len(salt) if isinstance(salt, bytes | bytearray) else type(salt).__name__
        raise ValueError(
            f"salt must be {SALT_BYTES_MIN}..{SALT_BYTES_MAX} bytes (a per-tenant secret), "
            f"got {size}"
        )
    if not isinstance(layout_id, bytes | bytearray) or len(layout_id) != LAYOUT_ID_BYTES:
        raise ValueError(f"layout_id must be {LAYOUT_ID_BYTES} bytes; use ChunkLayout.layout_id")
    if not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= _CHUNK_TOKENS_MAX:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is outside [1, {_CHUNK_TOKENS_MAX}]")
    arr = _tokens_u32(tokens)
    data = arr.view("u1").data
    step = chunk_tokens * 4
    keys: list[bytes] = []
    prev = _ZERO_KEY
    for i in range(arr.size // chunk_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=bytes(salt))
        h.update(layout_id)
        h.update(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
