"""Command builders: the SQEs a host sends (Fabrics, admin, NVM) with their field layouts.

Each builder returns an `Sqe`; the caller picks the command identifier. Where data goes with a
command, `sgl` says how: in-capsule (`SglType.DATA_BLOCK_OFFSET`, offset 0) or moved by the
transport (`SglType.TRANSPORT_DATA_BLOCK`, R2T/H2CData for writes, C2HData for reads).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvproto.nvme._sqe import Sgl, SglType, Sqe

__all__ = [
    "ADMIN_ICD_BYTES",
    "BLOCK_BYTES",
    "CONNECT_DATA_BYTES",
    "DISCOVERY_NQN",
    "DSM_RANGE_BYTES",
    "IDENTIFY_BYTES",
    "NQN_BYTES_MAX",
    "AdminOpcode",
    "Cns",
    "ConnectData",
    "ConnectDataError",
    "DsmRange",
    "FabricsType",
    "FeatureId",
    "IoOpcode",
    "LogPageId",
    "Property",
    "async_event_request",
    "connect",
    "data_sgl",
    "dataset_management",
    "flush",
    "get_features",
    "get_log_page",
    "identify",
    "keep_alive",
    "property_get",
    "property_set",
    "read",
    "set_features",
    "write",
    "write_zeroes",
]

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
NQN_BYTES_MAX = 223  # the spec's NQN limit (the field is 256 bytes, NUL-terminated)
CONNECT_DATA_BYTES = 1024
IDENTIFY_BYTES = 4096
DSM_RANGE_BYTES = 16
# The logical block of every namespace the project exports or reads (Identify Namespace LBA
# format lbads 12), and so the tiers' unit of I/O and one AES-XTS data unit.
BLOCK_BYTES = 4096
# The admin queue's in-capsule data size: the NVMe/TCP transport spec fixes it at 8 KiB.
ADMIN_ICD_BYTES = 8192


class AdminOpcode(enum.IntEnum):
    GET_LOG_PAGE = 0x02
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    KEEP_ALIVE = 0x18
    FABRICS = 0x7F


class IoOpcode(enum.IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    FABRICS = 0x7F


class FabricsType(enum.IntEnum):
    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECV = 0x06
    DISCONNECT = 0x08


class Cns(enum.IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NAMESPACES = 0x02
    NS_ID_DESCRIPTORS = 0x03


class LogPageId(enum.IntEnum):
    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    CHANGED_NAMESPACES = 0x04
    COMMANDS_EFFECTS = 0x05
    DISCOVERY = 0x70


class FeatureId(enum.IntEnum):
    ARBITRATION = 0x01
    POWER_MANAGEMENT = 0x02
    TEMPERATURE_THRESHOLD = 0x04
    ERROR_RECOVERY = 0x05
    VOLATILE_WRITE_CACHE = 0x06
    NUMBER_OF_QUEUES = 0x07
    INTERRUPT_COALESCING = 0x08
    WRITE_ATOMICITY = 0x0A
    ASYNC_EVENT_CONFIG = 0x0B
    KEEP_ALIVE_TIMER = 0x0F
    HOST_IDENTIFIER = 0x81


class Property(enum.IntEnum):
    """Controller property offsets and their sizes in bytes (Property Get/Set)."""

    CAP = 0x00
    VS = 0x08
    INTMS = 0x0C
    INTMC = 0x10
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20

    @property
    def size(self) -> int:
        return 8 if self is Property.CAP else 4


def data_sgl(length: int, *, in_capsule: bool) -> Sgl:
    """The one SGL descriptor of a command moving `length` bytes."""
    typ = SglType.DATA_BLOCK_OFFSET if in_capsule else SglType.TRANSPORT_DATA_BLOCK
    return Sgl(address=0, length=length, type=typ)


# hostid, cntlid, 238 reserved, subnqn[256], hostnqn[256], 256 reserved
_CONNECT_DATA = struct.Struct("<16sH238x256s256s256x")
assert _CONNECT_DATA.size == CONNECT_DATA_BYTES


class ConnectDataError(ValueError):
    """Malformed Connect data; `offset` is the byte offset of the bad field (for IPO)."""

    def __init__(self, msg: str, *, offset: int) -> None:
        super().__init__(msg)
        self.offset = offset


def _nqn_field(value: bytes, name: str, offset: int) -> str:
    end = value.find(b"\0")
    if end < 0:  # SPDK: "Connect SUBNQN/HOSTNQN is not null terminated"
        raise ConnectDataError(f"Connect {name} is not NUL-terminated", offset=offset)
    return value[:end].decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectData:
    """The 1024-byte data of a Fabrics Connect command."""

    hostid: bytes
    cntlid: int
    subnqn: str
    hostnqn: str

    def __post_init__(self) -> None:
        if len(self.hostid) != 16:
            raise ValueError(f"hostid must be 16 bytes, not {len(self.hostid)}")
        if not 0 <= self.cntlid < 65536:
            raise ValueError(f"cntlid {self.cntlid} is not a u16")
        for name in ("subnqn", "hostnqn"):
            raw = getattr(self, name).encode()
            if not 0 < len(raw) <= NQN_BYTES_MAX or b"\0" in raw:
                raise ValueError(f"{name} must be 1..{NQN_BYTES_MAX} bytes without NUL")

    def pack(self) -> bytes:
        return _CONNECT_DATA.pack(
            self.hostid, self.cntlid, self.subnqn.encode(), self.hostnqn.encode()
        )

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> ConnectData:
        """Raises ValueError (or RemoteProtocolError) when the data is malformed."""
        if len(buf) < CONNECT_DATA_BYTES:
            raise ConnectDataError(f"Connect data is {len(buf)} bytes", offset=0)
        hostid, cntlid, subnqn, hostnqn = _CONNECT_DATA.unpack_from(buf, 0)
        return cls(
            hostid=hostid,
            cntlid=cntlid,
            subnqn=_nqn_field(subnqn, "SUBNQN", 256),
            hostnqn=_nqn_field(hostnqn, "HOSTNQN", 512),
        )


def connect(
    *, cid: int, qid: int, sqsize: int, kato_ms: int = 0, cattr: int = 0, in_capsule: bool = True
) -> Sqe:
    """Fabrics Connect; `sqsize` is 0's based (queue depth - 1), `kato_ms` only for qid 0."""
    return Sqe(
        opcode=AdminOpcode.FABRICS,
        cid=cid,
        nsid=FabricsType.CONNECT,
        sgl=data_sgl(CONNECT_DATA_BYTES, in_capsule=in_capsule),
        cdw10=qid << 16,
        cdw11=sqsize | (cattr << 16),
        cdw12=kato_ms,
    )


def property_get(*, cid: int, prop: Property) -> Sqe:
    attrib = 1 if prop.size == 8 else 0
    return Sqe(
        opcode=AdminOpcode.FABRICS, cid=cid, nsid=FabricsType.PROPERTY_GET, cdw10=attrib, cdw11=prop
    )


def property_set(*, cid: int, prop: Property, value: int) -> Sqe:
    attrib = 1 if prop.size == 8 else 0
    return Sqe(
        opcode=AdminOpcode.FABRICS,
        cid=cid,
        nsid=FabricsType.PROPERTY_SET,
        cdw10=attrib,
        cdw11=prop,
        cdw12=value & 0xFFFFFFFF,
        cdw13=value >> 32,
    )


def identify(*, cid: int, cns: int, nsid: int = 0, cntid: int = 0) -> Sqe:
    return Sqe(
        opcode=AdminOpcode.IDENTIFY,
        cid=cid,
        nsid=nsid,
        sgl=data_sgl(IDENTIFY_BYTES, in_capsule=False),
        cdw10=cns | (cntid << 16),
    )


def get_log_page(
    *, cid: int, lid: int, length: int, offset: int = 0, nsid: int = 0xFFFFFFFF
) -> Sqe:
    """Get Log Page of `length` bytes (a multiple of 4) from byte `offset`."""
    assert length > 0 and length % 4 == 0 and offset % 4 == 0, (length, offset)
    numd = length // 4 - 1
    return Sqe(
        opcode=AdminOpcode.GET_LOG_PAGE,
        cid=cid,
        nsid=nsid,
        sgl=data_sgl(length, in_capsule=False),
        cdw10=lid | ((numd & 0xFFFF) << 16),
        cdw11=numd >> 16,
        cdw12=offset & 0xFFFFFFFF,
        cdw13=offset >> 32,
    )


def set_features(*, cid: int, fid: int, cdw11: int = 0) -> Sqe:
    return Sqe(opcode=AdminOpcode.SET_FEATURES, cid=cid, cdw10=fid, cdw11=cdw11)


def get_features(*, cid: int, fid: int) -> Sqe:
    return Sqe(opcode=AdminOpcode.GET_FEATURES, cid=cid, cdw10=fid)


def keep_alive(*, cid: int) -> Sqe:
    return Sqe(opcode=AdminOpcode.KEEP_ALIVE, cid=cid)


def async_event_request(*, cid: int) -> Sqe:
    return Sqe(opcode=AdminOpcode.ASYNC_EVENT_REQUEST, cid=cid)


def _rw(
    opcode: int, cid: int, nsid: int, slba: int, nlb: int, length: int, in_capsule: bool
) -> Sqe:
    assert 1 <= nlb <= 65536, nlb
    return Sqe(
        opcode=opcode,
        cid=cid,
        nsid=nsid,
        sgl=data_sgl(length, in_capsule=in_capsule),
        cdw10=slba & 0xFFFFFFFF,
        cdw11=slba >> 32,
        cdw12=nlb - 1,
    )


def read(*, cid: int, nsid: int, slba: int, nlb: int, block_size: int = BLOCK_BYTES) -> Sqe:
    """Read `nlb` blocks (1..65536) from `slba`."""
    return _rw(IoOpcode.READ, cid, nsid, slba, nlb, nlb * block_size, False)


def write(
    *, cid: int, nsid: int, slba: int, nlb: int, block_size: int = 4096, in_capsule: bool = False
) -> Sqe:
    return _rw(IoOpcode.WRITE, cid, nsid, slba, nlb, nlb * block_size, in_capsule)


def flush(*, cid: int, nsid: int) -> Sqe:
    return Sqe(opcode=IoOpcode.FLUSH, cid=cid, nsid=nsid)


def write_zeroes(*, cid: int, nsid: int, slba: int, nlb: int, deallocate: bool = False) -> Sqe:
    assert 1 <= nlb <= 65536, nlb
    return Sqe(
        opcode=IoOpcode.WRITE_ZEROES,
        cid=cid,
        nsid=nsid,
        cdw10=slba & 0xFFFFFFFF,
        cdw11=slba >> 32,
        cdw12=(nlb - 1) | (int(deallocate) << 25),
    )


_DSM_RANGE = struct.Struct("<IIQ")  # context attributes, length in blocks, starting LBA


@dataclass(frozen=True, slots=True, kw_only=True)
class DsmRange:
    slba: int
    nlb: int
    cattr: int = 0

    def pack(self) -> bytes:
        return _DSM_RANGE.pack(self.cattr, self.nlb, self.slba)

    @classmethod
    def unpack_many(cls, buf: bytes | bytearray | memoryview, count: int) -> list[DsmRange]:
        if len(buf) < count * DSM_RANGE_BYTES:
            raise ValueError(f"{count} DSM ranges need {count * DSM_RANGE_BYTES} bytes")
        return [
            cls(cattr=c, nlb=n, slba=s)
            for c, n, s in (_DSM_RANGE.unpack_from(buf, i * DSM_RANGE_BYTES) for i in range(count))
        ]


def dataset_management(
    *, cid: int, nsid: int, range_count: int, deallocate: bool = True, in_capsule: bool = True
) -> Sqe:
    """Dataset Management with `range_count` (1..256) ranges as its data."""
    assert 1 <= range_count <= 256, range_count
    length = range_count * DSM_RANGE_BYTES
    return Sqe(
        opcode=IoOpcode.DATASET_MANAGEMENT,
        cid=cid,
        nsid=nsid,
        sgl=data_sgl(length, in_capsule=in_capsule),
        cdw10=range_count - 1,
        cdw11=int(deallocate) << 2,
    )
