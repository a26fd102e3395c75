"""The LMCache plugin's parts that need no LMCache (addresses, keys, object shapes, the
keyed-chunk batches); host_shim.integrations.lmcache re-exports them and hands out the
connector classes (`_lmcache_connector`) on first access."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from host_shim.client import KVClient
from kvproto.keys import KEY_BYTES

__all__ = [
    "PLUGIN",
    "SCHEME",
    "KeyedChunks",
    "agent_address",
    "object_shape",
    "parse_dpukv_url",
    "tier_key",
]

SCHEME = "dpukv://"
PLUGIN = "dpukv"  # remote_storage_plugins entry; LMCache asks for "plugin://dpukv"
_PERSON = b"dpukv-lmcache-v1"  # BLAKE2b personalization (<= 16 bytes): LMCache keys only


def tier_key(salt: bytes, lmcache_key: str) -> bytes:
    """The 16-byte tier key of an LMCache key string, salted per tenant like chunk keys."""
    h = hashlib.blake2b(lmcache_key.encode(), digest_size=KEY_BYTES, key=salt, person=_PERSON)
    return h.digest()


def parse_dpukv_url(url: str) -> tuple[str, str]:
    """'dpukv://host:port/tenant' -> ('tcp://host:port', tenant); a cluster's seeds
    'dpukv://a:7400,b:7400/tenant' -> ('tcp://a:7400,b:7400', tenant) (KVClient routes)."""
    parts = urlsplit(url)
    tenant = parts.path.strip("/")
    bad = ValueError(f"LMCache remote_url {url!r}: use dpukv://HOST:PORT/TENANT (a cluster: "
                     "dpukv://HOST:PORT,HOST:PORT/TENANT)")  # fmt: skip
    if parts.scheme != "dpukv" or not parts.netloc or not tenant:
        raise bad
    seeds = parts.netloc.split(",")
    for seed in filter(None, seeds):
        try:
            one = urlsplit(f"tcp://{seed}")
            if not one.hostname or one.port is None:
                raise bad
        except ValueError:  # a port that is not a number
            raise bad from None
    if not any(seeds):
        raise bad
    return "tcp://" + ",".join(seeds), tenant


def agent_address(url: str, extra: Mapping[str, Any]) -> tuple[str, str]:
    """(control URL, tenant) for LMCache's `url`: ``plugin://dpukv[.NAME]`` takes both from
    ``extra_config`` (``dpukv.control``, ``dpukv.tenant``), ``dpukv://`` from the URL."""
    if not url.startswith("plugin://"):
        return parse_dpukv_url(url)
    control, tenant = extra.get("dpukv.control"), extra.get("dpukv.tenant")
    if not control or not tenant:
        raise ValueError(
            f"LMCache plugin {url!r}: extra_config needs dpukv.control "
            "(tcp://HOST:PORT of the agent) and dpukv.tenant"
        )
    return str(control), str(tenant)


def object_shape(full_shape: Sequence[int], full_bytes: int, length: int) -> list[int] | None:
    """The shape of an LMCache object of `length` bytes whose full chunk has `full_shape` and
    `full_bytes`: a partial (last) chunk has fewer tokens, in dim 2 of a 4-D KV_2LTD shape,
    else dim 0 (LMCache's `reshape_partial_chunk`). None when no whole number of tokens fits."""
    token_dim = 2 if len(full_shape) == 4 else 0
    tokens = int(full_shape[token_dim])
    if length <= 0 or length > full_bytes or full_bytes % tokens:
        return None
    per_token = full_bytes // tokens
    if length % per_token:
        return None
    shape = [int(d) for d in full_shape]
    shape[token_dim] = length // per_token
    return shape


class KeyedChunks:
    """LMCache objects by 16-byte key, through KVClient's key-level calls, in batches.

    Each object is one tier chunk of its own length (reserve, write, commit with checksum;
    lookup with lease, read, verify, release). A lost agent is a miss, as for KVClient.
    """

    def __init__(self, client: KVClient) -> None:
        self.client = client

    def count(self, keys: Sequence[bytes]) -> int:
        """How many leading objects of `keys` the tier holds."""
        return self.client.lookup_keys(keys) if keys else 0

    def lengths(self, keys: Sequence[bytes]) -> list[int]:
        """The byte length of each leading object of `keys` the tier holds."""
        return self.client.lookup_lengths(keys) if keys else []

    def read_into(self, keys: Sequence[bytes], bufs: Sequence[Any]) -> int:
        """Read objects into `bufs` (each exactly its object's length, as `lengths` said);
        returns how many leading ones were read and verified. Runs of equal length go in one
        call each (KVClient reads a batch of chunks of one size)."""
        done = 0
        for start, end in _runs([_nbytes(b) for b in bufs]):
            got = self.client.get_keys(
                keys[start:end], bufs[start:end], chunk_bytes=_nbytes(bufs[start])
            )
            done += got
            if got < end - start:
                break
        return done

    def write(self, keys: Sequence[bytes], bufs: Sequence[Any], first_parent: bytes | None) -> int:
        """Store objects (an object already stored under a key is kept: LMCache keys name
        their content); returns how many leading ones the tier holds. Each object's parent
        is the one before it (LMCache keys are a prefix chain): children are evicted first."""
        done = 0
        for start, end in _runs([_nbytes(b) for b in bufs]):
            parents = [keys[start - 1] if start else first_parent, *keys[start : end - 1]]
            got = self.client.put_keys(
                keys[start:end], bufs[start:end], parents, chunk_bytes=_nbytes(bufs[start])
            )
            done += got
            if got < end - start:
                break
        return done


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if hasattr(buf, "nbytes") else len(buf)


def _runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) spans of equal consecutive sizes."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or sizes[i] != sizes[start]:
            out.append((start, i))
            start = i
    return out
