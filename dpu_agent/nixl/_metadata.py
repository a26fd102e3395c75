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
the agent creates), each length against a stated maximum, the UCX worker address (below) and
the memory types (DRAM or VRAM). This is a filter in front of NIXL, not a proof: NIXL itself
runs in a worker process (dpu_agent.nixl._worker) whose abort costs only the calls in flight.

The UCX worker address is walked whole, in UCX's layout (src/ucp/wireup/address.c,
ucp_address_unpack; UCX 1.19-1.23, address formats v1 and v2, non-unified mode, which the
worker forces), so that the TCP endpoints inside it are known before UCX connects to them:

    header: v1 = version nibble | flags nibble << 4; v2 = version | release << 4, flags byte
    [uuid u64 (v1 always; v2 if flag 0x2)] [client id u64 (flag 0x4)] [name u8 len (flag 0x1)]
    0xff (no devices) | per device:
      md_index u8 (0x80 empty device; v2: 0x7f = next byte), dev_len u8 (0x80 last device,
      0x40 paths byte follows, 0x20 sys_dev byte follows, low 5 bits length; v2: 0x1f = next
      byte), [paths u8] [sys_dev u8], device address;
      unless empty, per transport: name checksum u16 (ucs_crc16 of its name), attributes
      (16 bytes in v1, 8 in v2), iface_len u8 (0x80 last, 0x40 ep addresses follow, low 6 bits
      length; v2: 0x3f = next byte), iface address, per ep address: len u8, bytes, lane u8
      (0x80 last)

For the tcp transport (uct_tcp_device_addr_t, uct_tcp_iface_addr_t): the device address is a
flags byte (0x1 loopback), the address family, then the IPv4/IPv6 address, or for loopback a
uct_iface_local_addr_ns_t (the host's system id u64 and a namespace u32: UCX connects to
127.0.0.1/::1 when they equal its own); the iface address is the port (big-endian u16).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from kvproto.control import NIXL_METADATA_BYTES_MAX, RemoteProtocolError

__all__ = [
    "NAME_BYTES_MAX",
    "NixlMetadata",
    "TcpEndpoint",
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
# Transport entries in one UCX address: UCX's own bound (UCP_MAX_RESOURCES), past which its
# unpacker refuses the address too.
UCX_TRANSPORTS_MAX = 128
# Endpoint addresses per transport entry: UCX's UCP_MAX_LANES.
UCX_EP_ADDRESSES_MAX = 64


def _crc16(name: bytes) -> int:
    """ucs_crc16_string (CRC-16-CCITT, reflected, inverted): UCX names a transport by it."""
    crc = 0xFFFF
    for c in name:
        crc ^= c
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


_TCP_CSUM = _crc16(b"tcp")
_AF_INET, _AF_INET6 = 2, 10  # Linux sa_family values, as UCX packs them
_TCP_LOOPBACK = 0x1  # UCT_TCP_DEVICE_ADDR_FLAG_LOOPBACK
_LOCAL_NS_BYTES = 12  # uct_iface_local_addr_ns_t: system id u64, namespace u32


@dataclass(frozen=True, slots=True)
class TcpEndpoint:
    """Where the agent's UCX would connect for one tcp entry of a peer's worker address."""

    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None  # None: UCX's loopback device
    port: int
    local_id: bytes = b""  # loopback only: the system id and namespace UCX compares to its own


@dataclass(frozen=True, slots=True)
class NixlMetadata:
    name: str
    backends: tuple[str, ...]
    regions: tuple[tuple[int, int, int, str], ...]  # addr, nbytes, dev, mem (what it registered)
    tcp: tuple[TcpEndpoint, ...] = ()  # the tcp endpoints inside its UCX worker address


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


class _Walk:
    """A cursor over one UCX worker address; running off its end is a refusal."""

    def __init__(self, addr: bytes, r: _Reader) -> None:
        self.addr, self.pos, self.r = addr, 0, r

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.addr):
            raise self.r.fail(f"UCX worker address: truncated in {what} (byte {self.pos})")
        self.pos += n
        return self.addr[self.pos - n : self.pos]

    def byte(self, what: str) -> int:
        return self.take(1, what)[0]

    def extended(self, value: int, mask: int, v2: bool, what: str) -> int:
        """A length or index whose all-ones value means "the next byte" (format v2 only)."""
        return self.byte(what) if v2 and value == mask else value


def _tcp_endpoint(dev: bytes, iface: bytes, r: _Reader) -> TcpEndpoint:
    if len(iface) != 2:
        raise r.fail(f"UCX tcp interface address of {len(iface)} bytes (a port: 2)")
    (port,) = struct.unpack(">H", iface)
    if len(dev) < 2:
        raise r.fail(f"UCX tcp device address of {len(dev)} bytes")
    flags, family, rest = dev[0], dev[1], dev[2:]
    if flags & _TCP_LOOPBACK:
        if family not in (_AF_INET, _AF_INET6) or len(rest) != _LOCAL_NS_BYTES:
            raise r.fail("UCX tcp loopback device address: not family + system id + namespace")
        return TcpEndpoint(ip=None, port=port, local_id=rest)
    if flags or (family, len(rest)) not in ((_AF_INET, 4), (_AF_INET6, 16)):
        raise r.fail(f"UCX tcp device address: flags {flags:#x}, family {family}, "
                     f"{len(rest)} address bytes")  # fmt: skip
    return TcpEndpoint(ip=ipaddress.ip_address(rest), port=port)


def _ucx_address(addr: bytes, r: _Reader) -> tuple[TcpEndpoint, ...]:
    """The tcp endpoints of a UCX worker address walked whole (layout in the module doc)."""
    if not UCX_ADDRESS_BYTES_MIN <= len(addr) <= UCX_ADDRESS_BYTES_MAX:
        raise r.fail(
            f"UCX worker address of {len(addr)} bytes "
            f"({UCX_ADDRESS_BYTES_MIN} to {UCX_ADDRESS_BYTES_MAX})"
        )
    version = addr[0] & 0x0F
    if version not in UCX_ADDRESS_VERSIONS:
        raise r.fail(f"UCX worker address of format version {version} (0 or 1)")
    w, v2 = _Walk(addr, r), version == 1
    w.take(1, "header")
    flags = w.byte("header flags") if v2 else addr[0] >> 4
    if not v2 or flags & 0x2:  # worker uuid (v1: always, under UCX's default unpack flags)
        w.take(8, "worker uuid")
    if flags & 0x4:  # client id
        w.take(8, "client id")
    if flags & 0x1:  # debug info: the worker's name
        w.take(w.byte("worker name length"), "worker name")
    if w.take(1, "first device")[0] == 0xFF:  # UCP_NULL_RESOURCE: no devices
        if w.pos != len(addr):
            raise r.fail("UCX worker address: bytes after an empty device list")
        return ()
    w.pos -= 1
    attr_len = 8 if v2 else 16  # ucp_address_v2_packed_iface_attr_t / packed_iface_attr_t
    tcp: list[TcpEndpoint] = []
    entries = 0
    while True:
        md = w.byte("md index")
        w.extended(md & 0x7F, 0x7F, v2, "md index")
        b = w.byte("device address length")
        dev_len = w.extended(b & 0x1F, 0x1F, v2, "device address length")
        if b & 0x40:
            w.take(1, "path count")
        if b & 0x20:
            w.take(1, "system device")
        dev = w.take(dev_len, "device address")
        last_tl = bool(md & 0x80)  # an empty device carries no transports
        while not last_tl:
            entries += 1
            if entries > UCX_TRANSPORTS_MAX:
                raise r.fail(f"UCX worker address: over {UCX_TRANSPORTS_MAX} transports")
            (csum,) = struct.unpack("<H", w.take(2, "transport name checksum"))
            w.take(attr_len, "transport attributes")
            f = w.byte("interface address length")
            last_tl, has_ep = bool(f & 0x80), bool(f & 0x40)
            iface = w.take(w.extended(f & 0x3F, 0x3F, v2, "interface address length"),
                           "interface address")  # fmt: skip
            eps = 0
            while has_ep:
                eps += 1
                if eps > UCX_EP_ADDRESSES_MAX:
                    raise r.fail(f"UCX worker address: over {UCX_EP_ADDRESSES_MAX} ep addresses")
                w.take(w.byte("ep address length"), "ep address")
                has_ep = not w.byte("lane") & 0x80
            if csum == _TCP_CSUM:
                tcp.append(_tcp_endpoint(dev, iface, r))
        if b & 0x80:  # the last device
            break
    if w.pos != len(addr):
        raise r.fail(f"UCX worker address: {len(addr) - w.pos} bytes after the last device")
    return tuple(tcp)


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
    tcp: tuple[TcpEndpoint, ...] = ()
    for _ in range(r.u64(b"Conns", "connection count", CONNS_MAX)):
        backend = r.entry(b"t", 64, "backend name").decode("ascii", "replace")
        if backend not in BACKENDS:
            raise r.fail(f"backend {backend!r} (only {sorted(BACKENDS)})")
        if backend in backends:
            raise r.fail(f"backend {backend!r} twice")
        conn = r.entry(b"c", UCX_ADDRESS_BYTES_MAX, "connection info")
        tcp = _ucx_address(conn, r)
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
    return NixlMetadata(name=name, backends=tuple(backends), regions=tuple(regions), tcp=tcp)
