"""64-byte submission queue entries and 16-byte completion queue entries (NVMe base spec).

On fabrics the data pointer is always one SGL descriptor (PSDT = 01b); the Fabrics commands
(opcode 0x7F) put their command type where a normal command has the low byte of NSID.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvproto.nvme._errors import Fes, RemoteProtocolError

__all__ = [
    "CQE_BYTES",
    "SQE_BYTES",
    "Cqe",
    "Sct",
    "Sgl",
    "SglType",
    "Sqe",
    "Status",
]

SQE_BYTES = 64
CQE_BYTES = 16

# opcode, flags, cid, nsid, cdw2, cdw3, mptr, sgl(address, length, 3 reserved, type), cdw10-15
_SQE = struct.Struct("<BBHIIIQQI3xBIIIIII")
_CQE = struct.Struct("<IIHHHH")  # cdw0, cdw1, sqhd, sqid, cid, status
assert _SQE.size == SQE_BYTES and _CQE.size == CQE_BYTES

PSDT_SGL = 0x40  # flags bits 7:6 = 01b: SGL for data, MPTR contiguous (what SPDK's host sets)


class SglType(enum.IntEnum):
    """Descriptor type (high nibble) and subtype (low nibble) as one byte."""

    DATA_BLOCK_OFFSET = 0x01  # in-capsule data: address = offset into the capsule's data
    TRANSPORT_DATA_BLOCK = 0x5A  # data moved by the transport (R2T/H2CData or C2HData)


class Sct(enum.IntEnum):
    GENERIC = 0
    COMMAND_SPECIFIC = 1
    MEDIA = 2
    PATH = 3
    VENDOR = 7


class Status(enum.IntEnum):
    """Status codes the target returns: (SCT << 8) | SC, so one value names both."""

    SUCCESS = 0x000
    INVALID_OPCODE = 0x001
    INVALID_FIELD = 0x002
    DATA_TRANSFER_ERROR = 0x004
    INTERNAL_DEVICE_ERROR = 0x006
    INVALID_NAMESPACE = 0x00B
    COMMAND_SEQUENCE_ERROR = 0x00C
    SGL_DESCRIPTOR_TYPE_INVALID = 0x011
    DATA_SGL_LENGTH_INVALID = 0x00F
    TRANSIENT_TRANSPORT_ERROR = 0x022
    LBA_OUT_OF_RANGE = 0x080
    ACCESS_DENIED = 0x286  # SCT 2 (media and data integrity), SC 86h
    INVALID_QUEUE_SIZE = 0x102
    ASYNC_EVENT_LIMIT_EXCEEDED = 0x105
    INVALID_LOG_PAGE = 0x109
    FEATURE_NOT_SAVEABLE = 0x10D
    # Fabrics command-specific (Connect)
    CONNECT_INCOMPATIBLE_FORMAT = 0x180
    CONNECT_CONTROLLER_BUSY = 0x181
    CONNECT_INVALID_PARAMETERS = 0x182
    CONNECT_INVALID_HOST = 0x184
    AUTHENTICATION_REQUIRED = 0x191  # a command before DH-HMAC-CHAP completed on the queue


@dataclass(frozen=True, slots=True, kw_only=True)
class Sgl:
    address: int = 0
    length: int = 0
    type: int = SglType.TRANSPORT_DATA_BLOCK

    def __post_init__(self) -> None:
        if not (0 <= self.address < 1 << 64 and 0 <= self.length < 1 << 32):
            raise ValueError(f"SGL address {self.address} or length {self.length} out of range")
        if not 0 <= self.type < 256:
            raise ValueError(f"SGL type {self.type} is not one byte")


_NO_SGL = Sgl(length=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sqe:
    """One submission queue entry; `cdw10`..`cdw15` hold the command-specific fields."""

    opcode: int
    cid: int = 0
    flags: int = PSDT_SGL
    nsid: int = 0
    cdw2: int = 0
    cdw3: int = 0
    mptr: int = 0
    sgl: Sgl = _NO_SGL
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.opcode < 256 and 0 <= self.flags < 256 and 0 <= self.cid < 65536):
            raise ValueError(f"opcode {self.opcode}, flags {self.flags} or cid {self.cid} bad")
        dwords = (
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        )
        if min(dwords) < 0 or max(dwords) >= 1 << 32:
            raise ValueError(f"SQE dwords {dwords} must be u32")
        if not 0 <= self.mptr < 1 << 64:
            raise ValueError(f"SQE mptr={self.mptr} is not a u64")

    def pack(self) -> bytes:
        g = self.sgl
        return _SQE.pack(
            self.opcode,
            self.flags,
            self.cid,
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.mptr,
            g.address,
            g.length,
            g.type,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        )

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Sqe:
        if len(buf) != SQE_BYTES:
            raise RemoteProtocolError(
                f"SQE is {len(buf)} bytes, not {SQE_BYTES}", fes=Fes.INVALID_PDU_HEADER_FIELD
            )
        (op, fl, cid, nsid, c2, c3, mptr, addr, length, typ, c10, c11, c12, c13, c14, c15) = (
            _SQE.unpack(buf)
        )
        return cls(
            opcode=op,
            flags=fl,
            cid=cid,
            nsid=nsid,
            cdw2=c2,
            cdw3=c3,
            mptr=mptr,
            sgl=Sgl(address=addr, length=length, type=typ),
            cdw10=c10,
            cdw11=c11,
            cdw12=c12,
            cdw13=c13,
            cdw14=c14,
            cdw15=c15,
        )

    @property
    def fctype(self) -> int:
        """Fabrics command type (byte 4 of a Fabrics command, where NSID's low byte sits)."""
        return self.nsid & 0xFF


@dataclass(frozen=True, slots=True, kw_only=True)
class Cqe:
    """One completion queue entry. `status` is the 15-bit status field without the phase tag."""

    cid: int
    status: int = 0
    cdw0: int = 0
    cdw1: int = 0
    sqhd: int = 0
    sqid: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.cid < 65536 and 0 <= self.sqhd < 65536 and 0 <= self.sqid < 65536):
            raise ValueError(f"CQE cid {self.cid}, sqhd {self.sqhd} or sqid {self.sqid} bad")
        if not (0 <= self.cdw0 < 1 << 32 and 0 <= self.cdw1 < 1 << 32):
            raise ValueError(f"CQE cdw0 {self.cdw0} or cdw1 {self.cdw1} is not a u32")
        if not 0 <= self.status < 1 << 15:
            raise ValueError(f"CQE status {self.status:#x} is not 15 bits")

    @classmethod
    def error(
        cls,
        *,
        cid: int,
        status: Status,
        dnr: bool = True,
        cdw0: int = 0,
        sqhd: int = 0,
        sqid: int = 0,
    ) -> Cqe:
        """A completion with (SCT, SC) from `status`; DNR set unless the error is transient."""
        value = ((status >> 8) << 8) | (status & 0xFF) | (int(dnr) << 14)
        return cls(cid=cid, status=value, cdw0=cdw0, sqhd=sqhd, sqid=sqid)

    @property
    def sc(self) -> int:
        return self.status & 0xFF

    @property
    def sct(self) -> int:
        return (self.status >> 8) & 0x7

    @property
    def dnr(self) -> bool:
        return bool(self.status & (1 << 14))

    @property
    def code(self) -> int:
        """(SCT << 8) | SC, comparable with `Status` members."""
        return self.status & 0x7FF

    @property
    def ok(self) -> bool:
        return self.code == 0

    def pack(self) -> bytes:
        # On the wire the status field is bit 0 = phase tag, bits 15:1 = the status proper.
        return _CQE.pack(self.cdw0, self.cdw1, self.sqhd, self.sqid, self.cid, self.status << 1)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Cqe:
        if len(buf) != CQE_BYTES:
            raise RemoteProtocolError(
                f"CQE is {len(buf)} bytes, not {CQE_BYTES}", fes=Fes.INVALID_PDU_HEADER_FIELD
            )
        cdw0, cdw1, sqhd, sqid, cid, status = _CQE.unpack(buf)
        return cls(cid=cid, status=status >> 1, cdw0=cdw0, cdw1=cdw1, sqhd=sqhd, sqid=sqid)
