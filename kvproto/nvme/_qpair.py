"""The NVMe/TCP queue-pair state machine: bytes in, PDU events out; PDUs in, bytes out.

Sans-I/O, in the style of h11: the owner feeds received bytes and pulls events,

    qp.receive_data(buf)
    while (ev := qp.next_event()) is not NEED_DATA: ...

or, to receive without copying, asks where the next bytes go (what asyncio's BufferedProtocol
and `socket.recv_into` want): `view = qp.get_buffer(); n = sock.recv_into(view);
qp.buffer_updated(n)`. Headers land in a small staging buffer; the data of a PDU goes straight
into the memoryview the owner's `sink` returns for it (the command's buffer), so bulk data is
received once, in place. Only the part of the data already read into staging is copied
(at most STAGING_BYTES per PDU).

Every (role, state, direction, PDU type) that is allowed is in QP_TRANSITIONS; anything else is a
protocol error: RemoteProtocolError for what the peer sent (carrying the FES and FEI for the
TermReq), LocalProtocolError for what we tried to send. After either, the state is ERROR.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable

from kvproto.nvme._errors import Fes, LocalProtocolError, ProtocolError, RemoteProtocolError
from kvproto.nvme._pdu import (
    CH,
    DIGEST_BYTES,
    HLEN,
    PDA_MAX,
    PDU_DIGEST_TYPES,
    PFV,
    R2T,
    TERM_REQ_DATA_BYTES_MAX,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    Pdu,
    PduFlags,
    PduType,
    crc32c,
    encode_pdu,
    unpack_data_header,
    unpack_digest,
    unpack_ic,
    unpack_term,
)
from kvproto.nvme._sqe import Cqe, Sqe

__all__ = [
    "NEED_DATA",
    "QP_TRANSITIONS",
    "STAGING_BYTES",
    "Direction",
    "QpState",
    "QueuePair",
    "Role",
    "Sink",
]

# Staging buffer for headers: big enough for the largest header with digest and padding
# (8 + 128 + 4 + pdo padding < 512) plus small PDUs batched in one recv; small enough that the
# data of a large PDU mostly bypasses it (copying 16 KiB per MiB costs ~1.5 %).
STAGING_BYTES = 16 * 1024
HEADER_BYTES_MAX = 512  # pdo is one byte: header + digest + padding always fits in 512
MIN_MAXH2CDATA = 4096  # the spec's lower bound for ICResp MAXH2CDATA


class Role(enum.Enum):
    HOST = "host"
    CONTROLLER = "controller"


class Direction(enum.Enum):
    RECV = "recv"
    SEND = "send"


class QpState(enum.Enum):
    IDLE = "idle"  # host: ICReq not sent yet
    AWAIT_IC = "await_ic"  # waiting for ICReq (controller) or ICResp (host)
    IC_RECEIVED = "ic_received"  # controller: ICReq in, ICResp not sent yet
    READY = "ready"
    CLOSED = "closed"  # a TermReq was sent or received
    ERROR = "error"


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _Sentinel.NEED_DATA

H, C = Role.HOST, Role.CONTROLLER
R, S = Direction.RECV, Direction.SEND
QP_TRANSITIONS: dict[tuple[Role, QpState, Direction, type], QpState] = {
    # host
    (H, QpState.IDLE, S, ICReq): QpState.AWAIT_IC,
    (H, QpState.AWAIT_IC, R, ICResp): QpState.READY,
    (H, QpState.AWAIT_IC, R, C2HTermReq): QpState.CLOSED,
    (H, QpState.READY, S, CapsuleCmd): QpState.READY,
    (H, QpState.READY, S, H2CData): QpState.READY,
    (H, QpState.READY, R, CapsuleResp): QpState.READY,
    (H, QpState.READY, R, C2HData): QpState.READY,
    (H, QpState.READY, R, R2T): QpState.READY,
    (H, QpState.READY, R, C2HTermReq): QpState.CLOSED,
    (H, QpState.AWAIT_IC, S, H2CTermReq): QpState.CLOSED,
    (H, QpState.READY, S, H2CTermReq): QpState.CLOSED,
    (H, QpState.ERROR, S, H2CTermReq): QpState.CLOSED,
    # controller
    (C, QpState.AWAIT_IC, R, ICReq): QpState.IC_RECEIVED,
    (C, QpState.AWAIT_IC, R, H2CTermReq): QpState.CLOSED,
    (C, QpState.IC_RECEIVED, S, ICResp): QpState.READY,
    (C, QpState.READY, R, CapsuleCmd): QpState.READY,
    (C, QpState.READY, R, H2CData): QpState.READY,
    (C, QpState.READY, S, CapsuleResp): QpState.READY,
    (C, QpState.READY, S, C2HData): QpState.READY,
    (C, QpState.READY, S, R2T): QpState.READY,
    (C, QpState.READY, R, H2CTermReq): QpState.CLOSED,
    (C, QpState.AWAIT_IC, S, C2HTermReq): QpState.CLOSED,
    (C, QpState.IC_RECEIVED, S, C2HTermReq): QpState.CLOSED,
    (C, QpState.READY, S, C2HTermReq): QpState.CLOSED,
    (C, QpState.ERROR, S, C2HTermReq): QpState.CLOSED,
}
# Per (role, state, direction): PDU class -> next state, derived from QP_TRANSITIONS.
_ROWS: dict[tuple[Role, QpState, Direction], dict[type, QpState]] = {
    (role, state, d): {} for role in Role for state in QpState for d in Direction
}
for (_role, _state, _dir, _cls), _next in QP_TRANSITIONS.items():
    _ROWS[(_role, _state, _dir)][_cls] = _next
_F_LAST_PDU = int(PduFlags.LAST_PDU)  # plain ints: IntFlag arithmetic is slow per PDU
_F_SUCCESS = int(PduFlags.SUCCESS)
_PDU_TYPES = {int(t): t for t in PduType}

_CLASS_OF: dict[int, type] = {
    PduType.IC_REQ: ICReq,
    PduType.IC_RESP: ICResp,
    PduType.H2C_TERM_REQ: H2CTermReq,
    PduType.C2H_TERM_REQ: C2HTermReq,
    PduType.CAPSULE_CMD: CapsuleCmd,
    PduType.CAPSULE_RESP: CapsuleResp,
    PduType.H2C_DATA: H2CData,
    PduType.C2H_DATA: C2HData,
    PduType.R2T: R2T,
}

# sink(pdu_type, cid, ttag, offset, length) -> a writable memoryview of exactly `length` bytes
# where the data of that PDU goes; it raises RemoteProtocolError for data nobody asked for.
Sink = Callable[[PduType, int, int, int, int], memoryview]


class _Phase(enum.Enum):
    HEADER = 0
    DATA = 1
    DDGST = 2


def _bad(msg: str, fes: Fes, fei: int, hdr: bytes) -> RemoteProtocolError:
    return RemoteProtocolError(msg, fes=fes, fei=fei, header=hdr)


class QueuePair:
    """One side of one NVMe/TCP connection (admin or I/O queue)."""

    def __init__(
        self,
        role: Role,
        *,
        sink: Sink | None = None,
        capsule_data_bytes_max: int = 0,
        data_pdu_bytes_max: int = 1 << 20,
    ) -> None:
        """`capsule_data_bytes_max`: in-capsule data accepted (controller: ICDOFF/IOCCSZ);
        `data_pdu_bytes_max`: data accepted in one H2CData/C2HData PDU."""
        self.role = role
        self._recv_next: dict[type, QpState] = {}
        self._send_next: dict[type, QpState] = {}
        self.state = QpState.IDLE if role is Role.HOST else QpState.AWAIT_IC
        self._sink = sink
        self._capsule_max = capsule_data_bytes_max
        self._data_pdu_max = data_pdu_bytes_max
        # negotiated at connection setup
        self.hdgst = False
        self.ddgst = False
        self.hpda = 0  # controller: what the host asked for in ICReq
        self.send_pda = 0  # alignment of the data we send
        self.maxh2cdata = 0  # host: from ICResp
        self.maxr2t = 0
        self._requested_digests = (False, False)
        # receiving
        self._staging = bytearray(STAGING_BYTES)
        self._sview = memoryview(self._staging)
        self._rpos = 0
        self._wpos = 0
        self._direct = False
        self._phase = _Phase.HEADER
        self._events: collections.deque[Pdu] = collections.deque()
        self._error: ProtocolError | None = None  # found after PDUs not yet taken
        self._pending: tuple[int, int, int, int, int, int, object] = (0, 0, 0, 0, 0, 0, None)
        self._data: memoryview = memoryview(b"")
        self._data_done = 0

    @property
    def state(self) -> QpState:
        return self._state

    @state.setter
    def state(self, value: QpState) -> None:
        """Set the state and cache its rows of QP_TRANSITIONS (no enum hashing per PDU)."""
        self._state = value
        self._recv_next = _ROWS[(self.role, value, Direction.RECV)]
        self._send_next = _ROWS[(self.role, value, Direction.SEND)]

    # -- sending --------------------------------------------------------------------------

    def send(self, pdu: Pdu) -> list[bytes | bytearray | memoryview]:
        """Check that `pdu` may be sent now and encode it (buffers to write in order)."""
        nxt = self._send_next.get(type(pdu))
        if nxt is None:
            old = self.state
            if not isinstance(pdu, H2CTermReq | C2HTermReq):
                self.state = QpState.ERROR
            raise LocalProtocolError(f"{self.role.value} cannot send {type(pdu).__name__} in {old}")
        if isinstance(pdu, ICReq):
            self._requested_digests = (pdu.hdgst, pdu.ddgst)
            return self._commit(nxt, encode_pdu(pdu))
        if isinstance(pdu, ICResp):
            if (pdu.hdgst and not self._requested_digests[0]) or (
                pdu.ddgst and not self._requested_digests[1]
            ):
                raise LocalProtocolError("ICResp enables a digest the host did not ask for")
            out = encode_pdu(pdu)
            self.hdgst, self.ddgst = pdu.hdgst, pdu.ddgst
            self.send_pda = self.hpda
            return self._commit(nxt, out)
        return self._commit(
            nxt, encode_pdu(pdu, hdgst=self.hdgst, ddgst=self.ddgst, pda=self.send_pda)
        )

    def _commit(
        self, nxt: QpState, out: list[bytes | bytearray | memoryview]
    ) -> list[bytes | bytearray | memoryview]:
        if nxt is not self._state:
            self.state = nxt
        return out

    def term_req(self, error: RemoteProtocolError) -> list[bytes | bytearray | memoryview]:
        """Encode the TermReq that answers `error` (C2HTermReq from a controller)."""
        cls = C2HTermReq if self.role is Role.CONTROLLER else H2CTermReq
        data = bytes(error.header[:TERM_REQ_DATA_BYTES_MAX])
        return self.send(cls(fes=int(error.fes), fei=error.fei, data=data))

    # -- receiving ------------------------------------------------------------------------

    def next_event(self) -> Pdu | _Sentinel:
        """The next complete PDU, or NEED_DATA. A protocol error found while parsing is
        raised here, after the PDUs that came before it (so they are answered in order)."""
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            error, self._error = self._error, None
            self.state = QpState.ERROR
            raise error
        return NEED_DATA

    @property
    def at_pdu_boundary(self) -> bool:
        """True when no PDU is partly received (a clean place for the peer to close)."""
        return self._phase is _Phase.HEADER and self._rpos == self._wpos

    @property
    def data_remaining(self) -> int:
        """Bytes of the current PDU's data not received yet (0 between data phases)."""
        return len(self._data) - self._data_done if self._phase is _Phase.DATA else 0

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copies them; `get_buffer`/`buffer_updated` avoid the copy)."""
        view, off = memoryview(data).cast("B"), 0
        while off < len(view) and self._error is None:
            buf = self.get_buffer()
            n = min(len(buf), len(view) - off)
            buf[:n] = view[off : off + n]
            off += n
            self.buffer_updated(n)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go: the current PDU's data buffer, else staging."""
        if self.state is QpState.ERROR or self._error is not None:
            raise LocalProtocolError("queue pair is in ERROR: close the connection")
        if self._phase is _Phase.DATA and self._rpos == self._wpos:
            self._direct = True
            return self._data[self._data_done :]
        self._direct = False
        if self._rpos == self._wpos:
            self._rpos = self._wpos = 0
        elif STAGING_BYTES - self._wpos < HEADER_BYTES_MAX:
            n = self._wpos - self._rpos
            self._staging[:n] = self._staging[self._rpos : self._wpos]
            self._rpos, self._wpos = 0, n
        return self._sview[self._wpos :]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written into the last `get_buffer()`; parse what is complete."""
        assert nbytes >= 0, nbytes
        if self.state is QpState.ERROR or self._error is not None:
            raise LocalProtocolError("queue pair is in ERROR: close the connection")
        if self._direct:
            self._data_done += nbytes
            assert self._data_done <= len(self._data), (self._data_done, len(self._data))
        else:
            self._wpos += nbytes
            assert self._wpos <= STAGING_BYTES, self._wpos
        try:
            self._parse()
        except ProtocolError as e:
            self._fail(e)
        except (ValueError, OverflowError) as e:  # a field out of range in an event we built
            self._fail(RemoteProtocolError(str(e), fes=Fes.INVALID_PDU_HEADER_FIELD))

    def _fail(self, error: ProtocolError) -> None:
        """Raise now, or from next_event() once the PDUs parsed before it are taken."""
        if self._events:
            self._error = error
            return
        self.state = QpState.ERROR
        raise error

    def _parse(self) -> None:
        while True:
            if self._phase is _Phase.HEADER:
                if not self._parse_header():
                    return
            if self._phase is _Phase.DATA:
                avail = self._wpos - self._rpos
                want = len(self._data) - self._data_done
                if avail and want:
                    n = min(avail, want)
                    end = self._data_done + n
                    self._data[self._data_done : end] = self._sview[self._rpos : self._rpos + n]
                    self._data_done, self._rpos = end, self._rpos + n
                if self._data_done < len(self._data):
                    return
                self._phase = _Phase.DDGST
            if self._phase is _Phase.DDGST:
                if not self._finish_data_pdu():
                    return

    def _parse_header(self) -> bool:
        avail = self._wpos - self._rpos
        if avail < CH.size:
            return False
        view = self._sview[self._rpos : self._wpos]
        ptype, flags, hlen, pdo, plen = CH.unpack_from(view, 0)
        cls = _CLASS_OF.get(ptype)
        hdr = bytes(view[: min(avail, HLEN.get(ptype, CH.size), TERM_REQ_DATA_BYTES_MAX)])
        if cls is None:
            raise _bad(f"unknown PDU type {ptype:#x}", Fes.INVALID_PDU_HEADER_FIELD, 0, hdr)
        if cls not in self._recv_next:
            raise RemoteProtocolError(
                f"{cls.__name__} not expected by the {self.role.value} in {self.state.value}",
                fes=Fes.PDU_SEQUENCE_ERROR,
                header=hdr,
            )
        if hlen != HLEN[ptype]:
            raise _bad(
                f"{cls.__name__} hlen {hlen} != {HLEN[ptype]}", Fes.INVALID_PDU_HEADER_FIELD, 2, hdr
            )
        dg = DIGEST_BYTES if self.hdgst and ptype in PDU_DIGEST_TYPES else 0
        header_end = hlen + dg
        data_len, data_start = self._check_lengths(ptype, cls, hlen, header_end, pdo, plen, hdr)
        need = data_start if data_len and cls is not H2CTermReq and cls is not C2HTermReq else plen
        if avail < need:
            return False
        if dg and crc32c(view[:hlen]) != unpack_digest(view[hlen:header_end]):
            raise _bad(f"{cls.__name__} header digest mismatch", Fes.HEADER_DIGEST_ERROR, 0, hdr)
        psh = view[CH.size : hlen]
        if cls is ICReq or cls is ICResp:
            self._rpos += plen
            self._events.append(self._ic(cls, psh, hdr))
            return True
        if cls is H2CTermReq or cls is C2HTermReq:
            fes, fei = unpack_term(psh)
            data = bytes(view[hlen:plen])
            self._rpos += plen
            self.state = self._recv_next[cls]
            self._events.append(cls(fes=fes, fei=fei, data=data))
            return True
        if cls is CapsuleResp:
            self._rpos += plen
            self._events.append(CapsuleResp(cqe=Cqe.unpack(psh)))
            return True
        return self._start_data(ptype, cls, flags, psh, data_len, data_start, hdr)

    def _check_lengths(
        self, ptype: int, cls: type, hlen: int, header_end: int, pdo: int, plen: int, hdr: bytes
    ) -> tuple[int, int]:
        """(data length, data offset) of the PDU, after checking plen and pdo."""
        name = cls.__name__
        if cls is ICReq or cls is ICResp:
            if plen != hlen:
                raise _bad(f"{name} plen {plen} != {hlen}", Fes.INVALID_PDU_HEADER_FIELD, 4, hdr)
            return 0, plen
        if cls is H2CTermReq or cls is C2HTermReq:
            if not hlen <= plen <= hlen + TERM_REQ_DATA_BYTES_MAX:
                raise _bad(f"{name} plen {plen} out of range", Fes.INVALID_PDU_HEADER_FIELD, 4, hdr)
            return plen - hlen, hlen
        if ptype not in (PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA):
            if plen != header_end:
                raise _bad(
                    f"{name} plen {plen} != {header_end}", Fes.INVALID_PDU_HEADER_FIELD, 4, hdr
                )
            return 0, plen
        if plen == header_end and cls is CapsuleCmd:
            return 0, plen
        if not header_end <= pdo < plen:
            raise _bad(
                f"{name} pdo {pdo} outside {header_end}..{plen}",
                Fes.INVALID_PDU_HEADER_FIELD,
                3,
                hdr,
            )
        data_len = plen - pdo - (DIGEST_BYTES if self.ddgst else 0)
        limit = self._capsule_max if cls is CapsuleCmd else self._data_pdu_max
        if data_len <= 0:
            raise _bad(f"{name} plen {plen} leaves no data", Fes.INVALID_PDU_HEADER_FIELD, 4, hdr)
        if data_len > limit:
            raise _bad(
                f"{name} carries {data_len} bytes, limit {limit}",
                Fes.DATA_TRANSFER_LIMIT_EXCEEDED,
                4,
                hdr,
            )
        return data_len, pdo

    def _ic(self, cls: type, psh: memoryview, hdr: bytes) -> ICReq | ICResp:
        pfv, pda, dgst, last = unpack_ic(psh)
        if pfv != PFV:
            raise _bad(
                f"{cls.__name__} PFV {pfv} unsupported", Fes.INVALID_PDU_HEADER_FIELD, 8, hdr
            )
        if pda > PDA_MAX:
            raise _bad(
                f"{cls.__name__} PDA {pda} > {PDA_MAX}", Fes.INVALID_PDU_HEADER_FIELD, 10, hdr
            )
        hd, dd = bool(dgst & 1), bool(dgst & 2)
        if cls is ICReq:
            self.state = QpState.IC_RECEIVED
            self.hpda, self.maxr2t, self._requested_digests = pda, last, (hd, dd)
            return ICReq(pfv=pfv, hpda=pda, hdgst=hd, ddgst=dd, maxr2t=last)
        if (hd and not self._requested_digests[0]) or (dd and not self._requested_digests[1]):
            raise _bad(
                "ICResp enables a digest the host did not ask for",
                Fes.UNSUPPORTED_PARAMETER,
                11,
                hdr,
            )
        if last < MIN_MAXH2CDATA:
            raise _bad(
                f"ICResp MAXH2CDATA {last} < {MIN_MAXH2CDATA}",
                Fes.INVALID_PDU_HEADER_FIELD,
                12,
                hdr,
            )
        self.state = QpState.READY
        self.hdgst, self.ddgst, self.send_pda, self.maxh2cdata = hd, dd, pda, last
        return ICResp(pfv=pfv, cpda=pda, hdgst=hd, ddgst=dd, maxh2cdata=last)

    def _start_data(
        self,
        ptype: int,
        cls: type,
        flags: int,
        psh: memoryview,
        data_len: int,
        data_start: int,
        hdr: bytes,
    ) -> bool:
        sqe: Sqe | None = None
        if cls is CapsuleCmd:
            sqe = Sqe.unpack(psh)
            cid, ttag, offset, datal = sqe.cid, 0, 0, data_len
        elif cls is R2T:
            cid, ttag, r2to, r2tl = unpack_data_header(psh)
            if r2tl == 0:
                raise _bad("R2T of zero bytes", Fes.INVALID_PDU_HEADER_FIELD, 16, hdr)
            self._rpos += data_start
            self._events.append(R2T(cccid=cid, ttag=ttag, r2to=r2to, r2tl=r2tl))
            return True
        else:
            cid, ttag, offset, datal = unpack_data_header(psh)
            if datal != data_len:
                raise _bad(
                    f"{cls.__name__} datal {datal} != {data_len} from plen",
                    Fes.INVALID_PDU_HEADER_FIELD,
                    16,
                    hdr,
                )
            if flags & _F_SUCCESS and not flags & _F_LAST_PDU:
                raise _bad("C2HData SUCCESS without LAST_PDU", Fes.INVALID_PDU_HEADER_FIELD, 1, hdr)
        self._rpos += data_start
        if data_len == 0:
            assert sqe is not None
            self._events.append(CapsuleCmd(sqe=sqe))
            return True
        if self._sink is not None:
            try:
                dest = self._sink(_PDU_TYPES[ptype], cid, ttag, offset, datal)
            except RemoteProtocolError as e:
                e.header = e.header or hdr
                raise
            assert len(dest) == datal and not dest.readonly, (len(dest), datal)
        else:
            dest = memoryview(bytearray(datal))
        self._data, self._data_done, self._phase = dest, 0, _Phase.DATA
        self._pending = (ptype, flags, cid, ttag, offset, datal, sqe)
        return True

    def _finish_data_pdu(self) -> bool:
        ok = True
        if self.ddgst:
            if self._wpos - self._rpos < DIGEST_BYTES:
                return False
            got = unpack_digest(self._sview[self._rpos : self._rpos + DIGEST_BYTES])
            self._rpos += DIGEST_BYTES
            ok = crc32c(self._data) == got
        ptype, flags, cid, ttag, offset, _, sqe = self._pending
        data, self._data, self._phase = self._data, memoryview(b""), _Phase.HEADER
        last = bool(flags & _F_LAST_PDU)
        ev: Pdu
        if ptype == PduType.CAPSULE_CMD:
            assert isinstance(sqe, Sqe)
            ev = CapsuleCmd(sqe=sqe, data=data, ddgst_ok=ok)
        elif ptype == PduType.H2C_DATA:
            ev = H2CData(cccid=cid, ttag=ttag, datao=offset, data=data, last=last, ddgst_ok=ok)
        else:
            success = bool(flags & _F_SUCCESS)
            ev = C2HData(
                cccid=cid, datao=offset, data=data, last=last, success=success, ddgst_ok=ok
            )
        self._events.append(ev)
        return True
