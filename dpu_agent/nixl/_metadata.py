"""NIXL agent metadata from a peer, parsed and checked here before NIXL sees a byte of it.

NIXL's loader (nixlAgentData::loadRemoteMD, nixlSerDes) and UCX's address unpacker trust their
input: UCX reads a worker address with no length and asserts on what it does not expect (one
bad version nibble aborts the process). So the whole blob is parsed by this module first, in the
exact layout nixl-cu12 writes, and anything else is refused with a clear error:

    "nixlSerDes|"
    entry   := tag, u64 LE length, value, "|"          (nixlSerDes::addStr / addBuf)
    "Agent" name | "Conns" u64 count | count x ("t" backend | "c" connection info)
    "" "MemSection" | "nixlSecElms" u64 count |
        count x ("bknd" backend | "nixlDList" "nixlSDList" | "t" u32 mem type | "n" u64 count |
                 count x ("" addr u64, len u64, dev u64, backend key bytes))
    and nothing after.

What is checked beyond the layout: the name (ASCII, bounded), backends (UCX only: the only one
the agent creates), each length against a stated maximum, the UCX worker address's header (its
version nibble is the assertion seen) and the memory types (DRAM or VRAM). This is a filter in
front of NIXL, not a proof: NIXL itself runs in a worker process (dpu_agent.nixl._worker) whose
abort costs only the calls in flight.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvproto.control import NIXL_METADATA_BYTES_MAX, RemoteProtocolError

__all__ = [
    "NAME_BYTES_MAX",
    "NixlMetadata",
    "parse_metadata",
]

_MAGIC = b"nixlSerDes|"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_DESC = struct.Struct("<QQQ")  # nixlBasicDesc: addr, len, devId

NAME_BYTES_MAX = 256  # host_shim names its agent dpukv.<tenant>.<host>.<pid>: well under this
# Backends one peer may list: NIXL ships about ten plugins; a host here lists one (UCX).
CONNS_MAX = 16
BACKENDS = frozenset({"UCX"})  # the only backend the agent's NIXL agent creates
# A UCX worker address is ~100 bytes over TCP and a few hundred with RDMA devices (measured
# 106 on loopback); 4 KiB leaves room for many NICs and is what UCX's 8-bit lengths allow.
UCX_ADDRESS_BYTES_MAX = 4096
# uuid flag set in the header, then the 8-byte uuid: the shortest address UCX packs.
UCX_ADDRESS_BYTES_MIN = 9
# UCP address header: low nibble is the format version (UCP_OBJECT_VERSION_V1 = 0, V2 = 1);
# any other value reaches an assertion in UCX's address.c.
UCX_ADDRESS_VERSIONS = frozenset({0, 1})
# Sections: one per backend and memory type (DRAM, VRAM).
SECTIONS_MAX = 2 * CONNS_MAX
# Descriptors in all sections: the host registers at most NIXL_REGIONS_MAX regions and drops
# before it adds; twice that covers one call's additions before its drops land.
DESCS_MAX = 2 * 4096
# A UCX remote key is ~10 bytes over TCP and ~100 with RDMA devices; 4 KiB is generous.
RKEY_BYTES_MAX = 4096
MEM_TYPES = {0: "DRAM", 1: "VRAM"}  # nixl_mem_t: DRAM_SEG, VRAM_SEG


@dataclass(frozen=True, slots=True)
class NixlMetadata:
    name: str
    backends: tuple[str, ...]
    regions: tuple[tuple[int, int, int, str], ...]  # addr, nbytes, dev, mem (what it registered)


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.pos = blob, len(_MAGIC)

    def fail(self, what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"nixl metadata: {what} (at byte {self.pos})")

    def entry(self, tag: bytes, max_len: int, what: str) -> bytes:
        b, p = self.blob, self.pos
        if b[p : p + len(tag)] != tag:
            raise self.fail(f"expected {what} (tag {tag.decode()!r})")
        p += len(tag)
        if p + _U64.size > len(b):
            raise self.fail(f"{what}: truncated length")
        (n,) = _U64.unpack_from(b, p)
        p += _U64.size
        if n > max_len:
            raise self.fail(f"{what} of {n} bytes (max {max_len})")
        if p + n + 1 > len(b):
            raise self.fail(f"{what}: truncated ({n} bytes announced)")
        if b[p + n] != ord("|"):
            raise self.fail(f"{what}: no '|' after the value")
        self.pos = p + n + 1
        return b[p : p + n]

    def u64(self, tag: bytes, what: str, max_value: int) -> int:
        raw = self.entry(tag, _U64.size, what)
        if len(raw) != _U64.size:
            raise self.fail(f"{what}: {len(raw)} bytes, not 8")
        (v,) = _U64.unpack(raw)
        if v > max_value:
            raise self.fail(f"{what} = {v} (max {max_value})")
        return v

    def exact(self, tag: bytes, value: bytes, what: str) -> None:
        if self.entry(tag, len(value), what) != value:
            raise self.fail(f"{what}: not {value.decode()!r}")


def _check_ucx_address(addr: bytes, r: _Reader) -> None:
    if not UCX_ADDRESS_BYTES_MIN <= len(addr) <= UCX_ADDRESS_BYTES_MAX:
        raise r.fail(
            f"UCX worker address of {len(addr)} bytes "
            f"({UCX_ADDRESS_BYTES_MIN} to {UCX_ADDRESS_BYTES_MAX})"
        )
    if addr[0] & 0x0F not in UCX_ADDRESS_VERSIONS:
        raise r.fail(f"UCX worker address of format version {addr[0] & 0x0F} (0 or 1)")


def parse_metadata(blob: bytes) -> NixlMetadata:
    """The checked contents of a host agent's NIXL metadata, or RemoteProtocolError."""
    if not isinstance(blob, bytes) or not 0 < len(blob) <= NIXL_METADATA_BYTES_MAX:
        raise RemoteProtocolError(f"nixl metadata: 1 to {NIXL_METADATA_BYTES_MAX} bytes")
    if not blob.startswith(_MAGIC):
        raise RemoteProtocolError("nixl metadata: not NIXL agent metadata (nixlSerDes|Agent)")
    r = _Reader(blob)
    raw = r.entry(b"Agent", NAME_BYTES_MAX, "agent name")
    if not raw or not all(0x21 <= c < 0x7F for c in raw):
        raise r.fail(f"agent name of {len(raw)} bytes is not printable ASCII")
    name = raw.decode("ascii")
    backends = []
    for _ in range(r.u64(b"Conns", "connection count", CONNS_MAX)):
        backend = r.entry(b"t", 64, "backend name").decode("ascii", "replace")
        if backend not in BACKENDS:
            raise r.fail(f"backend {backend!r} (only {sorted(BACKENDS)})")
        if backend in backends:
            raise r.fail(f"backend {backend!r} twice")
        conn = r.entry(b"c", UCX_ADDRESS_BYTES_MAX, "connection info")
        _check_ucx_address(conn, r)
        backends.append(backend)
    r.exact(b"", b"MemSection", "memory section")
    regions: list[tuple[int, int, int, str]] = []
    for _ in range(r.u64(b"nixlSecElms", "section count", SECTIONS_MAX)):
        backend = r.entry(b"bknd", 64, "section backend").decode("ascii", "replace")
        if backend not in backends:
            raise r.fail(f"section of backend {backend!r} with no connection info")
        r.exact(b"nixlDList", b"nixlSDList", "descriptor list")
        raw_type = r.entry(b"t", _U32.size, "memory type")
        mem = MEM_TYPES.get(_U32.unpack(raw_type)[0]) if len(raw_type) == _U32.size else None
        if mem is None:
            raise r.fail("memory type (DRAM or VRAM)")
        n = r.u64(b"n", "descriptor count", DESCS_MAX - len(regions))
        if n == 0:
            raise r.fail("empty descriptor list")
        for _ in range(n):
            desc = r.entry(b"", _DESC.size + RKEY_BYTES_MAX, "descriptor")
            if len(desc) <= _DESC.size:
                raise r.fail(f"descriptor of {len(desc)} bytes (no remote key)")
            addr, nbytes, dev = _DESC.unpack_from(desc)
            if nbytes == 0 or addr + nbytes > 1 << 64:
                raise r.fail(f"descriptor [{addr:#x}, {nbytes}] wraps or is empty")
            regions.append((addr, nbytes, dev, mem))
    if r.pos != len(blob):
        raise r.fail(f"{len(blob) - r.pos} bytes after the last section")
    return NixlMetadata(name=name, backends=tuple(backends), regions=tuple(regions))
