"""KVStore: the one interface of the tier's client, and the checks every implementation shares.

host_shim.client.NodeClient (one agent) and host_shim.cluster.ClusterRouter (a NodeClient per
member) implement it; host_shim.client.KVClient holds the one its URL names. Both import this
module, and the router is handed NodeClient by KVClient, so the modules import one way:
client -> cluster -> _store.
"""

from __future__ import annotations

import asyncio
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from host_shim.control import ControlChannel
from kvproto.control import LOOKUP_KEYS_MAX
from kvproto.keys import KEY_BYTES, ChunkLayout, chunk_keys

__all__ = ["CHUNKS_PER_CALL_MAX", "KVStore", "byte_view"]

CHUNKS_PER_CALL_MAX = LOOKUP_KEYS_MAX  # one lookup request takes this many keys


def byte_view(buf: Any, nbytes: int, *, writable: bool) -> memoryview:
    """A flat, C-contiguous uint8 view of `buf` (numpy, bytearray, memoryview, torch CPU tensor).

    Objects without the buffer protocol (torch tensors) go through `.numpy()`, or a uint8
    `.view()` for dtypes numpy lacks (bfloat16); torch itself is never imported here.
    """
    obj = buf
    if not isinstance(obj, np.ndarray | bytes | bytearray | memoryview) and hasattr(obj, "numpy"):
        if getattr(obj, "device", None) is not None and str(obj.device) != "cpu":
            raise ValueError(f"buffer on {obj.device}: give a CPU tensor (GPU memory needs gpu.py)")
        try:
            obj = obj.numpy()
        except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy dtype
            torch = sys.modules["torch"]
            obj = obj.view(torch.uint8).numpy()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"buffer of shape {obj.shape} is not C-contiguous")
        view = obj.reshape(-1).view(np.uint8).data
    else:
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("buffer is not C-contiguous")
        view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
    if writable and view.readonly:
        raise ValueError(f"buffer of type {type(buf).__name__} is read-only; get() writes into it")
    if view.nbytes != nbytes:
        raise ValueError(f"buffer holds {view.nbytes} bytes; a chunk of this layout is {nbytes}")
    return view


class KVStore(ABC):
    """The one interface of the tier's client, for one agent (NodeClient) or a cluster
    (host_shim.cluster.ClusterRouter over NodeClients); KVClient picks one from the URL.

    Key-level calls are what an implementation provides; token-level calls (lookup, get,
    put, lease, delete by tokens) and prefetch are built on them here, once.
    """

    layout: ChunkLayout
    _salt: bytes

    def _init_keys(self, layout: ChunkLayout, salt: bytes) -> None:
        self.layout = layout
        self._salt = bytes(salt)
        chunk_keys(
            np.zeros(0, dtype=np.uint32),
            salt=self._salt,
            layout_id=layout.layout_id,
            chunk_tokens=layout.chunk_tokens,
        )  # validates the salt now, not mid-inference

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- token-level calls ------------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """One 16-byte key per full chunk of `tokens` (at most CHUNKS_PER_CALL_MAX chunks)."""
        n = self.layout.chunk_tokens
        if len(tokens) // n > CHUNKS_PER_CALL_MAX:
            raise ValueError(
                f"{len(tokens)} tokens make {len(tokens) // n} chunks of {n}; one call takes at "
                f"most {CHUNKS_PER_CALL_MAX} ({CHUNKS_PER_CALL_MAX * n} tokens): split the call"
            )
        return chunk_keys(tokens, salt=self._salt, layout_id=self.layout.layout_id, chunk_tokens=n)

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading full chunks of `tokens` the tier holds."""
        return self.lookup_keys(self.keys(tokens))

    def get(self, tokens: Sequence[int] | np.ndarray, into: Sequence[Any]) -> int:
        """Load the cached prefix into `into[0..]`; returns how many leading chunks were loaded.

        Each buffer holds layout.chunk_bytes; every chunk's checksum is verified, and the first
        failure or missing chunk ends the prefix.
        """
        return self.get_keys(self.keys(tokens), into)

    def put(self, tokens: Sequence[int] | np.ndarray, chunks: Sequence[Any]) -> int:
        """Store chunks of `tokens` (skipping those already cached); returns how many leading
        chunks the tier holds afterwards. One chunk buffer per full chunk of `tokens` (the
        partial last chunk is not stored)."""
        keys = self.keys(tokens)
        if len(chunks) != len(keys):
            raise ValueError(
                f"{len(tokens)} tokens make {len(keys)} full chunks of "
                f"{self.layout.chunk_tokens}, but {len(chunks)} chunk buffers were given: give "
                "one per full chunk (put_keys() stores a subset by key)"
            )
        return self.put_keys(keys, chunks)

    def lease(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """lookup() that also leases the cached prefix (the agent neither evicts nor frees it
        until release_lease() or the lease TTL): (chunks, lease_id); lease_id 0 holds nothing.
        For a scheduler that promises chunks now and loads them a step later."""
        keys = self.keys(tokens)
        if not keys:
            return 0, 0
        return self.lease_keys(keys)

    def delete(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Drop the chunks of `tokens`; returns how many were there."""
        keys = self.keys(tokens)
        return self.delete_keys(keys) if keys else 0

    def lookup_keys(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of `keys` the tier holds."""
        return len(self.lookup_lengths(keys))

    async def prefetch(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Touch the cached prefix (the agent promotes it) without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.lookup, tokens)

    # --- what an implementation provides ----------------------------------------------------
    @abstractmethod
    def lookup_lengths(self, keys: Sequence[bytes]) -> list[int]:
        """The byte length of each leading cached chunk of `keys`: a buffer for get_keys()
        when chunks are not all layout.chunk_bytes long (LMCache objects)."""

    @abstractmethod
    def get_keys(
        self, keys: Sequence[bytes], into: Sequence[Any], *, chunk_bytes: int | None = None
    ) -> int:
        """get() by key: load the cached prefix of `keys[:len(into)]` into `into[0..]`.

        Each buffer holds `chunk_bytes` (default layout.chunk_bytes); a stored chunk of another
        length is a miss. Checksums are verified as in get().
        """

    @abstractmethod
    def put_keys(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> int:
        """put() by key: store `chunks` under `keys[:len(chunks)]` (skipping those already
        cached); returns how many leading chunks the tier holds afterwards.

        `parents[i]` is the key chunk i extends (the agent evicts children first); by default
        the previous key, None for the first. Each chunk holds `chunk_bytes` (default
        layout.chunk_bytes).
        """

    @abstractmethod
    def lease_keys(self, keys: list[bytes]) -> tuple[int, int]:
        """lease() by key: (leading chunks held, lease_id); lease_id 0 holds nothing."""

    @abstractmethod
    def release_lease(self, lease_id: int) -> None:
        """Give back a lease from lease(); a lost agent or an expired lease is not an error
        (the agent dropped it already)."""

    @abstractmethod
    def delete_keys(self, keys: list[bytes]) -> int:
        """delete() by key: how many of `keys` were there."""

    @property
    @abstractmethod
    def transport(self) -> str:
        """The data path in use: "nixl" or "nvme-tcp" ("" before the first connect)."""

    @property
    @abstractmethod
    def channel(self) -> ControlChannel:
        """A connected control channel (stats, members, raw calls)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """The tenant's stats as the agent (or each member) reports them."""

    @abstractmethod
    def close(self) -> None:
        """Release every connection and thread; idempotent."""


def _checked_keys(keys: Sequence[bytes], what: str) -> list[bytes]:
    """`keys` as a list, or ValueError naming the first key that is not a 16-byte tier key."""
    if len(keys) > CHUNKS_PER_CALL_MAX:
        raise ValueError(
            f"{len(keys)} {what} in one call; at most {CHUNKS_PER_CALL_MAX}: split the call"
        )
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(
                f"{what}[{i}] is {key!r:.60}, not {KEY_BYTES} bytes; tier keys come from "
                "KVClient.keys() or a 16-byte hash of the engine's own key"
            )
    return list(keys)
