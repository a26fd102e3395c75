"""NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0) as events, and their encoder.

Every PDU starts with the 8-byte common header (type, flags, hlen, pdo, plen), then the
PDU-specific header, an optional header digest, padding up to `pdo`, data, and an optional data
digest. Digests are CRC32C stored little-endian; ICReq/ICResp and TermReqs never carry them.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import crc32c as _crc32c

from kvproto.nvme._sqe import CQE_BYTES, SQE_BYTES, Cqe, Sqe

__all__ = [
    "CH",
    "DIGEST_BYTES",
    "HLEN",
    "PDU_DATA_TYPES",
    "PDU_DIGEST_TYPES",
    "R2T",
    "TERM_REQ_DATA_BYTES_MAX",
    "C2HData",
    "C2HTermReq",
    "CapsuleCmd",
    "CapsuleResp",
    "H2CData",
    "H2CTermReq",
    "ICReq",
    "ICResp",
    "Pdu",
    "PduFlags",
    "PduType",
    "crc32c",
    "encode_pdu",
]


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


class PduType(enum.IntEnum):
    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class PduFlags(enum.IntFlag):
    HDGSTF = 0x01
    DDGSTF = 0x02
    LAST_PDU = 0x04  # H2CData, C2HData
    SUCCESS = 0x08  # C2HData: the command succeeded and no CapsuleResp follows


CH = struct.Struct("<BBBBI")  # pdu_type, flags, hlen, pdo, plen
DIGEST_BYTES = 4
_DIGEST = struct.Struct("<I")
_IC = struct.Struct("<HBBI")  # pfv, hpda|cpda, dgst, maxr2t|maxh2cdata (then 112 reserved)
_TERM = struct.Struct("<HI")  # fes, fei (then 10 reserved)
_DATA = struct.Struct("<HHII4x")  # cccid, ttag (reserved in C2HData), datao|r2to, datal|r2tl

# Header length of each PDU type; a PDU with another hlen is malformed.
HLEN: dict[int, int] = {
    PduType.IC_REQ: 128,
    PduType.IC_RESP: 128,
    PduType.H2C_TERM_REQ: 24,
    PduType.C2H_TERM_REQ: 24,
    PduType.CAPSULE_CMD: CH.size + SQE_BYTES,
    PduType.CAPSULE_RESP: CH.size + CQE_BYTES,
    PduType.H2C_DATA: 24,
    PduType.C2H_DATA: 24,
    PduType.R2T: 24,
}
# Types that carry a header digest when one was negotiated, and types that may carry data.
PDU_DIGEST_TYPES = frozenset(
    {PduType.CAPSULE_CMD, PduType.CAPSULE_RESP, PduType.H2C_DATA, PduType.C2H_DATA, PduType.R2T}
)
PDU_DATA_TYPES = frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA})
# A TermReq echoes the offending PDU header: at most 152 bytes (the spec's limit; SPDK's
# SPDK_NVME_TCP_TERM_REQ_ERROR_DATA_MAX_SIZE), enough for a 128-byte ICReq and more.
TERM_REQ_DATA_BYTES_MAX = 152
PFV = 0  # the only PDU format version defined
PDA_MAX = 31  # HPDA/CPDA are 5-bit: alignment (pda + 1) * 4 bytes, up to 128


def _u(value: int, bits: int, name: str) -> None:
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name}={value} does not fit in {bits} bits")


@dataclass(frozen=True, slots=True, kw_only=True)
class ICReq:
    pfv: int = PFV
    hpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxr2t: int = 0  # 0's based: outstanding R2Ts per command the host accepts, minus one

    def __post_init__(self) -> None:
        _u(self.pfv, 16, "pfv")
        _u(self.hpda, 8, "hpda")
        _u(self.maxr2t, 32, "maxr2t")


@dataclass(frozen=True, slots=True, kw_only=True)
class ICResp:
    pfv: int = PFV
    cpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxh2cdata: int = 131072

    def __post_init__(self) -> None:
        _u(self.pfv, 16, "pfv")
        _u(self.cpda, 8, "cpda")
        _u(self.maxh2cdata, 32, "maxh2cdata")


@dataclass(frozen=True, slots=True, kw_only=True)
class H2CTermReq:
    fes: int
    fei: int = 0
    data: bytes = b""  # the offending PDU header

    def __post_init__(self) -> None:
        _u(self.fes, 16, "fes")
        _u(self.fei, 32, "fei")
        if len(self.data) > TERM_REQ_DATA_BYTES_MAX:
            raise ValueError(f"TermReq data of {len(self.data)} > {TERM_REQ_DATA_BYTES_MAX}")


@dataclass(frozen=True, slots=True, kw_only=True)
class C2HTermReq:
    fes: int
    fei: int = 0
    data: bytes = b""

    def __post_init__(self) -> None:
        _u(self.fes, 16, "fes")
        _u(self.fei, 32, "fei")
        if len(self.data) > TERM_REQ_DATA_BYTES_MAX:
            raise ValueError(f"TermReq data of {len(self.data)} > {TERM_REQ_DATA_BYTES_MAX}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CapsuleCmd:
    sqe: Sqe
    data: bytes | bytearray | memoryview = b""  # in-capsule data
    ddgst_ok: bool = True  # False: the data digest did not match (complete with a transient error)


@dataclass(frozen=True, slots=True, kw_only=True)
class CapsuleResp:
    cqe: Cqe


@dataclass(frozen=True, slots=True, kw_only=True)
class H2CData:
    cccid: int
    ttag: int
    datao: int
    data: bytes | bytearray | memoryview
    last: bool = True
    ddgst_ok: bool = True

    def __post_init__(self) -> None:
        _u(self.cccid, 16, "cccid")
        _u(self.ttag, 16, "ttag")
        _u(self.datao, 32, "datao")
        if not 0 < len(self.data) < 1 << 32:
            raise ValueError(f"H2CData needs 1..2^32-1 bytes of data, not {len(self.data)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class C2HData:
    cccid: int
    datao: int
    data: bytes | bytearray | memoryview
    last: bool = True
    success: bool = False  # only with last: the command succeeded, no CapsuleResp follows
    ddgst_ok: bool = True

    def __post_init__(self) -> None:
        _u(self.cccid, 16, "cccid")
        _u(self.datao, 32, "datao")
        if not 0 < len(self.data) < 1 << 32:
            raise ValueError(f"C2HData needs 1..2^32-1 bytes of data, not {len(self.data)}")
        if self.success and not self.last:
            raise ValueError("C2HData SUCCESS is only allowed with LAST_PDU")


@dataclass(frozen=True, slots=True, kw_only=True)
class R2T:
    cccid: int
    ttag: int
    r2to: int
    r2tl: int

    def __post_init__(self) -> None:
        _u(self.cccid, 16, "cccid")
        _u(self.ttag, 16, "ttag")
        _u(self.r2to, 32, "r2to")
        _u(self.r2tl, 32, "r2tl")
        if self.r2tl == 0:
            raise ValueError("R2T of zero bytes")


Pdu = ICReq | ICResp | H2CTermReq | C2HTermReq | CapsuleCmd | CapsuleResp | H2CData | C2HData | R2T

_TYPE_OF: dict[type, PduType] = {
    ICReq: PduType.IC_REQ,
    ICResp: PduType.IC_RESP,
    H2CTermReq: PduType.H2C_TERM_REQ,
    C2HTermReq: PduType.C2H_TERM_REQ,
    CapsuleCmd: PduType.CAPSULE_CMD,
    CapsuleResp: PduType.CAPSULE_RESP,
    H2CData: PduType.H2C_DATA,
    C2HData: PduType.C2H_DATA,
    R2T: PduType.R2T,
}


def pdu_type_of(pdu: Pdu) -> PduType:
    return _TYPE_OF[type(pdu)]


def _psh(pdu: Pdu) -> tuple[bytes, int]:
    """The PDU-specific header bytes (after the common header) and the type's flag bits."""
    if isinstance(pdu, CapsuleCmd):
        return pdu.sqe.pack(), 0
    if isinstance(pdu, CapsuleResp):
        return pdu.cqe.pack(), 0
    if isinstance(pdu, H2CData):
        return _DATA.pack(pdu.cccid, pdu.ttag, pdu.datao, len(pdu.data)), (0x04 if pdu.last else 0)
    if isinstance(pdu, C2HData):
        flags = (0x04 if pdu.last else 0) | (0x08 if pdu.success else 0)  # LAST_PDU, SUCCESS
        return _DATA.pack(pdu.cccid, 0, pdu.datao, len(pdu.data)), flags
    if isinstance(pdu, R2T):
        return _DATA.pack(pdu.cccid, pdu.ttag, pdu.r2to, pdu.r2tl), 0
    if isinstance(pdu, ICReq):
        dgst = int(pdu.hdgst) | int(pdu.ddgst) << 1
        return _IC.pack(pdu.pfv, pdu.hpda, dgst, pdu.maxr2t) + bytes(112), 0
    if isinstance(pdu, ICResp):
        dgst = int(pdu.hdgst) | int(pdu.ddgst) << 1
        return _IC.pack(pdu.pfv, pdu.cpda, dgst, pdu.maxh2cdata) + bytes(112), 0
    assert isinstance(pdu, H2CTermReq | C2HTermReq), pdu
    return _TERM.pack(pdu.fes, pdu.fei) + bytes(10), 0


def encode_pdu(
    pdu: Pdu, *, hdgst: bool = False, ddgst: bool = False, pda: int = 0
) -> list[bytes | bytearray | memoryview]:
    """Encode `pdu` as a list of buffers to send in order (the data is not copied).

    `hdgst`/`ddgst`: the digests negotiated at connection setup; `pda`: the receiver's PDU data
    alignment (its HPDA or CPDA), data starting at a multiple of (pda + 1) * 4 bytes if nonzero.
    """
    ptype = _TYPE_OF[type(pdu)]
    psh, flags = _psh(pdu)
    hlen = CH.size + len(psh)
    assert hlen == HLEN[ptype], (ptype, hlen)
    if ptype in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        data: bytes | bytearray | memoryview = pdu.data  # type: ignore[union-attr]
        header = CH.pack(ptype, 0, hlen, 0, hlen + len(data)) + psh
        return [header, data] if data else [header]
    use_hdgst = hdgst and ptype in PDU_DIGEST_TYPES
    data = getattr(pdu, "data", b"") if ptype in PDU_DATA_TYPES else b""
    use_ddgst = ddgst and len(data) > 0
    flags |= (0x01 if use_hdgst else 0) | (0x02 if use_ddgst else 0)  # HDGSTF, DDGSTF
    header_end = hlen + (DIGEST_BYTES if use_hdgst else 0)
    pdo = 0
    if data:
        pdo = header_end
        if pda:
            align = (pda + 1) * 4
            pdo = -(-header_end // align) * align
    plen = (pdo if data else header_end) + len(data) + (DIGEST_BYTES if use_ddgst else 0)
    header = CH.pack(ptype, flags, hlen, pdo, plen) + psh
    if use_hdgst:
        header += _DIGEST.pack(crc32c(header))
    if pdo > header_end:
        header += bytes(pdo - header_end)
    if not data:
        return [header]
    if use_ddgst:
        return [header, data, _DIGEST.pack(crc32c(data))]
    return [header, data]


def unpack_ic(buf: memoryview) -> tuple[int, int, int, int]:
    """(pfv, pda, dgst, last field) of an ICReq/ICResp PDU-specific header."""
    return _IC.unpack_from(buf, 0)


def unpack_term(buf: memoryview) -> tuple[int, int]:
    return _TERM.unpack_from(buf, 0)


def unpack_data_header(buf: memoryview) -> tuple[int, int, int, int]:
    return _DATA.unpack_from(buf, 0)


def unpack_digest(buf: memoryview) -> int:
    return int(_DIGEST.unpack_from(buf, 0)[0])
