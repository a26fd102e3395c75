"""Data structures commands return: Identify Controller/Namespace, the discovery log page.

Only the fields a fabrics target fills are modelled; the rest of each 4096-byte structure is
zero, as SPDK leaves it. Offsets are from the NVMe base specification.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvproto.nvme._commands import IDENTIFY_BYTES

__all__ = [
    "DISCOVERY_ENTRY_BYTES",
    "DISCOVERY_HEADER_BYTES",
    "DiscoveryEntry",
    "DiscoveryLog",
    "IdentifyController",
    "IdentifyNamespace",
    "ns_id_descriptors",
]

DISCOVERY_HEADER_BYTES = 1024
DISCOVERY_ENTRY_BYTES = 1024
TRTYPE_TCP = 3
ADRFAM_IPV4 = 1
ADRFAM_IPV6 = 2
SUBTYPE_DISCOVERY = 1
SUBTYPE_NVME = 2
CNTRLTYPE_IO = 1
CNTRLTYPE_DISCOVERY = 2


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", errors="replace").rstrip(" ")


def _pad(value: str, size: int, fill: bytes = b" ") -> bytes:
    raw = value.encode("ascii")[:size]
    return raw + fill * (size - len(raw))


# (name, offset, struct format) of each Identify Controller field we set or read.
_IDCTRL_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("vid", 0, "<H"),
    ("ssvid", 2, "<H"),
    ("sn", 4, "20s"),
    ("mn", 24, "40s"),
    ("fr", 64, "8s"),
    ("rab", 72, "B"),
    ("cmic", 76, "B"),
    ("mdts", 77, "B"),
    ("cntlid", 78, "<H"),
    ("ver", 80, "<I"),
    ("oaes", 92, "<I"),
    ("ctratt", 96, "<I"),
    ("cntrltype", 111, "B"),
    ("oacs", 256, "<H"),
    ("acl", 258, "B"),
    ("aerl", 259, "B"),
    ("frmw", 260, "B"),
    ("lpa", 261, "B"),
    ("elpe", 262, "B"),
    ("kas", 320, "<H"),
    ("sqes", 512, "B"),
    ("cqes", 513, "B"),
    ("maxcmd", 514, "<H"),
    ("nn", 516, "<I"),
    ("oncs", 520, "<H"),
    ("fuses", 522, "<H"),
    ("fna", 524, "B"),
    ("vwc", 525, "B"),
    ("awun", 526, "<H"),
    ("awupf", 528, "<H"),
    ("sgls", 536, "<I"),
    ("subnqn", 768, "256s"),
    ("ioccsz", 1792, "<I"),
    ("iorcsz", 1796, "<I"),
    ("icdoff", 1800, "<H"),
    ("fcatt", 1802, "B"),
    ("msdbd", 1803, "B"),
)
_IDCTRL_STRUCTS = tuple((n, o, struct.Struct(f)) for n, o, f in _IDCTRL_FIELDS)
_TEXT_FIELDS = {"sn": 20, "mn": 40, "fr": 8}


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentifyController:
    """Identify Controller (CNS 01h). Text fields are ASCII, space padded on the wire."""

    vid: int = 0
    ssvid: int = 0
    sn: str = ""
    mn: str = ""
    fr: str = ""
    rab: int = 6
    cmic: int = 0
    mdts: int = 0  # max transfer = 2^mdts * 4 KiB (CAP.MPSMIN); 0 = no limit
    cntlid: int = 0
    ver: int = 0x00010300
    oaes: int = 0
    ctratt: int = 0
    cntrltype: int = CNTRLTYPE_IO
    oacs: int = 0
    acl: int = 3
    aerl: int = 3
    frmw: int = 0
    lpa: int = 0
    elpe: int = 127
    kas: int = 0  # keep-alive granularity in 100 ms units
    sqes: int = 0x66
    cqes: int = 0x44
    maxcmd: int = 0
    nn: int = 0
    oncs: int = 0
    fuses: int = 0
    fna: int = 0
    vwc: int = 0
    awun: int = 0
    awupf: int = 0
    sgls: int = 0
    subnqn: str = ""
    ioccsz: int = 0
    iorcsz: int = 0
    icdoff: int = 0
    fcatt: int = 0
    msdbd: int = 0

    def pack(self) -> bytes:
        out = bytearray(IDENTIFY_BYTES)
        for name, off, st in _IDCTRL_STRUCTS:
            value = getattr(self, name)
            if name in _TEXT_FIELDS:
                value = _pad(value, _TEXT_FIELDS[name])
            elif name == "subnqn":
                value = value.encode()
            st.pack_into(out, off, value)
        return bytes(out)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> IdentifyController:
        if len(buf) < IDENTIFY_BYTES:
            raise ValueError(f"Identify Controller is {len(buf)} bytes, not {IDENTIFY_BYTES}")
        values: dict[str, object] = {}
        for name, off, st in _IDCTRL_STRUCTS:
            (value,) = st.unpack_from(buf, off)
            values[name] = _text(value) if isinstance(value, bytes) else value
        return cls(**values)  # type: ignore[arg-type]


_IDNS_HEAD = struct.Struct("<QQQBBBBBBBBB")  # nsze, ncap, nuse, nsfeat .. dlfeat (33)
_LBAF = struct.Struct("<HBB")  # ms, lbads, rp


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentifyNamespace:
    """Identify Namespace (CNS 00h) with one LBA format (index 0)."""

    nsze: int
    ncap: int
    nuse: int
    lbads: int = 12  # log2 of the block size: 12 = 4096 bytes
    nsfeat: int = 0
    nmic: int = 0
    dlfeat: int = 0
    nguid: bytes = field(default=bytes(16))
    eui64: bytes = field(default=bytes(8))

    @property
    def block_size(self) -> int:
        return 1 << self.lbads

    def pack(self) -> bytes:
        out = bytearray(IDENTIFY_BYTES)
        # nlbaf 0 (one format), flbas 0, mc, dpc, dps 0, nmic, rescap, fpi 0
        _IDNS_HEAD.pack_into(
            out, 0, self.nsze, self.ncap, self.nuse, self.nsfeat, 0, 0, 0, 0, 0, self.nmic, 0, 0
        )
        out[33] = self.dlfeat
        out[104:120] = self.nguid
        out[120:128] = self.eui64
        _LBAF.pack_into(out, 128, 0, self.lbads, 0)
        return bytes(out)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> IdentifyNamespace:
        if len(buf) < IDENTIFY_BYTES:
            raise ValueError(f"Identify Namespace is {len(buf)} bytes, not {IDENTIFY_BYTES}")
        nsze, ncap, nuse, nsfeat, _nlbaf, flbas, *_rest = _IDNS_HEAD.unpack_from(buf, 0)
        nmic = _rest[3]
        _ms, lbads, _rp = _LBAF.unpack_from(buf, 128 + 4 * (flbas & 0xF))
        return cls(
            nsze=nsze,
            ncap=ncap,
            nuse=nuse,
            lbads=lbads,
            nsfeat=nsfeat,
            nmic=nmic,
            dlfeat=buf[33],
            nguid=bytes(buf[104:120]),
            eui64=bytes(buf[120:128]),
        )


def ns_id_descriptors(*, nguid: bytes, uuid: bytes) -> bytes:
    """Namespace Identification Descriptor list (CNS 03h): NGUID (type 2) and UUID (type 3)."""
    out = bytearray(IDENTIFY_BYTES)
    out[0:4] = bytes([2, 16, 0, 0])
    out[4:20] = nguid
    out[20:24] = bytes([3, 16, 0, 0])
    out[24:40] = uuid
    return bytes(out)


# trtype adrfam subtype treq portid cntlid asqsz (22 reserved) trsvcid[32] (192 reserved)
# subnqn[256] traddr[256] tsas[256]
_ENTRY = struct.Struct("<BBBBHHH22x32s192x256s256s256s")
_LOG_HEAD = struct.Struct("<QQH")  # genctr, numrec, recfmt
assert _ENTRY.size == DISCOVERY_ENTRY_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryEntry:
    subnqn: str
    traddr: str
    trsvcid: str
    trtype: int = TRTYPE_TCP
    adrfam: int = ADRFAM_IPV4
    subtype: int = SUBTYPE_NVME
    treq: int = 2  # secure channel not required (what SPDK reports for TCP without TLS)
    portid: int = 0
    cntlid: int = 0xFFFF  # dynamic controller model
    asqsz: int = 128
    sectype: int = 0  # TSAS for TCP: no security

    def pack(self) -> bytes:
        tsas = bytes([self.sectype]) + bytes(255)
        return _ENTRY.pack(
            self.trtype,
            self.adrfam,
            self.subtype,
            self.treq,
            self.portid,
            self.cntlid,
            self.asqsz,
            _pad(self.trsvcid, 32),
            self.subnqn.encode(),
            _pad(self.traddr, 256),
            tsas,
        )

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> DiscoveryEntry:
        trtype, adrfam, subtype, treq, portid, cntlid, asqsz, svc, nqn, addr, tsas = (
            _ENTRY.unpack_from(buf, 0)
        )
        return cls(
            subnqn=_text(nqn),
            traddr=_text(addr),
            trsvcid=_text(svc),
            trtype=trtype,
            adrfam=adrfam,
            subtype=subtype,
            treq=treq,
            portid=portid,
            cntlid=cntlid,
            asqsz=asqsz,
            sectype=tsas[0],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryLog:
    genctr: int
    entries: tuple[DiscoveryEntry, ...]

    def pack(self) -> bytes:
        head = _LOG_HEAD.pack(self.genctr, len(self.entries), 0)
        head += bytes(DISCOVERY_HEADER_BYTES - len(head))
        return head + b"".join(e.pack() for e in self.entries)

    @staticmethod
    def record_count(buf: bytes | bytearray | memoryview) -> tuple[int, int]:
        """(genctr, numrec) from the first bytes of the log page."""
        genctr, numrec, _ = _LOG_HEAD.unpack_from(buf, 0)
        return genctr, numrec

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> DiscoveryLog:
        genctr, numrec = cls.record_count(buf)
        have = (len(buf) - DISCOVERY_HEADER_BYTES) // DISCOVERY_ENTRY_BYTES
        if have < numrec:
            raise ValueError(f"discovery log has {numrec} records, only {have} were read")
        entries = tuple(
            DiscoveryEntry.unpack(buf[DISCOVERY_HEADER_BYTES + i * DISCOVERY_ENTRY_BYTES :])
            for i in range(numrec)
        )
        return cls(genctr=genctr, entries=entries)
