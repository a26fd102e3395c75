"""One initiator queue pair: a blocking TCP socket around the sans-I/O codec.

Blocking sockets with `recv_into`/`sendmsg` are the fastest model measured here
(docs/MEASURED.md: 3.0 GB/s vs 2.6 for asyncio). Data of a read lands straight in the
caller's buffer: the codec's sink hands `recv_into` the slice of the caller's memory that the
C2HData PDU covers (the rest of a large PDU in one MSG_WAITALL call). Writes go out with
`sendmsg` from the caller's buffer (no copy). Timeouts are SO_RCVTIMEO/SO_SNDTIMEO on a
blocking socket: a Python socket timeout would add a poll() before every call.

Thread safety: `execute()` holds the queue's lock for the whole batch; one thread at a time
uses a queue pair, other threads wait or pick another queue.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from host_shim.nvme._errors import NvmeTransportError
from kvproto.nvme import (
    ADMIN_ICD_BYTES,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    Cqe,
    Fes,
    H2CData,
    ICReq,
    PduType,
    ProtocolError,
    QpState,
    QueuePair,
    RemoteProtocolError,
    Role,
    SglType,
    Sqe,
    Status,
)

__all__ = ["C2H_PDU_BYTES_MAX", "QueuePairSocket", "Request"]

# Sanity bound on one C2HData PDU; the sink bounds it exactly by the command's buffer.
C2H_PDU_BYTES_MAX = 64 << 20
SOCKET_BUFFER_BYTES = 4 << 20  # SO_RCVBUF/SO_SNDBUF asked for: a few MiB in flight per queue
# Data PDUs with more than this left are received with MSG_WAITALL: one recv() per PDU.
WAITALL_BYTES_MIN = 64 << 10
SEND_PARTS_MAX = 512
# Refill a queue once a quarter of its slots are free: one sendmsg (and one wakeup of the
# target) per few commands instead of one per completion; deep enough to stay busy.
REFILL_DIVISOR = 4  # buffers in one sendmsg (IOV_MAX is 1024 on Linux)

Buffer = bytes | bytearray | memoryview


class Request:
    """One command to run: `make(cid)` builds its SQE; data goes out of or into the views."""

    __slots__ = ("bad", "cqe", "data_in", "data_out", "make", "partial_ok", "received", "what")

    def __init__(
        self,
        make: Callable[[int], Sqe],
        *,
        what: str,
        data_out: memoryview | None = None,
        data_in: memoryview | None = None,
    ) -> None:
        self.make = make
        self.what = what
        self.data_out = data_out
        self.data_in = data_in
        self.cqe: Cqe | None = None
        self.received = 0
        self.bad = False
        self.partial_ok = False  # fewer bytes than data_in is fine (Authentication Receive)


class QueuePairSocket:
    """Admin (qid 0) or I/O queue pair over one TCP connection."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        qid: int,
        depth: int,
        timeout_s: float,
        hdgst: bool = False,
        ddgst: bool = False,
        tls: Callable[[socket.socket], Any] | None = None,
    ) -> None:
        """`tls`: wraps the connected socket (a TLS 1.3 secure channel, host_shim/nvme/_tls.py)."""
        assert 1 <= depth <= 65536, depth
        self.qid = qid
        self.depth = depth
        self.timeout_s = timeout_s
        self.icd_bytes = (
            ADMIN_ICD_BYTES if qid == 0 else 0
        )  # in-capsule data the controller accepts
        self.lock = threading.Lock()
        self.broken = ""
        self._inflight: dict[int, Request] = {}
        self._free_cids = list(range(depth - 1, -1, -1))
        self._done = 0
        self._qp = QueuePair(Role.HOST, sink=self._sink, data_pdu_bytes_max=C2H_PDU_BYTES_MAX)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            # The timeout lives in the kernel (SO_RCVTIMEO/SO_SNDTIMEO) and the socket is
            # plain blocking: a Python-level timeout would add a poll() before every call.
            tv = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._sock.settimeout(None)
            self._raw = self._sock  # abort() shuts this down, under any TLS wrapper
            if tls is not None:
                self._sock = tls(self._sock)
        except OSError as e:
            raise NvmeTransportError(f"cannot connect to {host}:{port}: {e}") from e
        self.peer = f"{host}:{port}"
        with self.lock:
            self._guard(self._handshake, hdgst, ddgst)
        self.maxh2cdata = self._qp.maxh2cdata

    def _handshake(self, hdgst: bool, ddgst: bool) -> None:
        self._send(self._qp.send(ICReq(hpda=0, hdgst=hdgst, ddgst=ddgst, maxr2t=0)))
        while self._qp.state is QpState.AWAIT_IC:
            self._pump()

    def close(self) -> None:
        self.broken = self.broken or "closed"
        try:
            self._sock.close()
        except OSError:
            pass

    def abort(self) -> None:
        """Close without waiting on the peer or on the queue's lock: shutdown() wakes a thread
        blocked in recv on this socket (close() alone would leave it blocked until its
        timeout), and nothing is sent that needs an answer."""
        self.broken = self.broken or "aborted"
        try:
            self._raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        self.close()

    def execute(self, requests: Sequence[Request]) -> None:
        """Run `requests` with up to `depth` in flight; each gets its `cqe`.

        Raises NvmeTransportError if the connection fails (the queue is then unusable).
        """
        with self.lock:
            self._guard(self._execute, requests)

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        """The one place where OSError and protocol errors become NvmeTransportError."""
        if self.broken:
            raise NvmeTransportError(f"queue {self.qid} to {self.peer} is unusable: {self.broken}")
        try:
            fn(*args)
        except RemoteProtocolError as e:
            self.broken = f"protocol error from target: {e}"
            try:
                self._send(self._qp.term_req(e))
            except (OSError, ProtocolError):
                pass
        except ProtocolError as e:
            self.broken = f"protocol error: {e}"
        except (TimeoutError, BlockingIOError) as e:  # SO_RCVTIMEO/SO_SNDTIMEO expired
            self.broken = f"no answer from {self.peer} in {self.timeout_s} s ({e})"
        except OSError as e:
            self.broken = f"connection to {self.peer} failed: {e}"
        except NvmeTransportError as e:
            self.broken = str(e)
        if self.broken:
            self._inflight.clear()
            self.close()
            raise NvmeTransportError(f"queue {self.qid} to {self.peer}: {self.broken}")

    def _execute(self, requests: Sequence[Request]) -> None:
        self._done = 0
        index = 0
        refill = max(1, self.depth // REFILL_DIVISOR)
        while self._done < len(requests):
            parts: list[Buffer] = []  # capsules submitted together go out in one sendmsg
            left = len(requests) - index
            if len(self._free_cids) < min(refill, left) and len(self._free_cids) < self.depth:
                self._pump()  # wait for a few slots: one sendmsg (one wakeup) for several
                continue
            while index < len(requests) and self._free_cids and len(parts) < SEND_PARTS_MAX:
                parts += self._submit(requests[index])
                index += 1
            if parts:
                self._send(parts)
            self._pump()

    def _submit(self, req: Request) -> list[Buffer]:
        cid = self._free_cids.pop()
        sqe = req.make(cid)
        self._inflight[cid] = req
        if req.data_out is not None and sqe.sgl.type == SglType.DATA_BLOCK_OFFSET:
            return self._qp.send(CapsuleCmd(sqe=sqe, data=req.data_out))
        return self._qp.send(CapsuleCmd(sqe=sqe))

    def _send(self, parts: list[Buffer]) -> None:
        bufs = [memoryview(p) for p in parts]
        while bufs:
            n = self._sock.sendmsg(bufs)
            while n:
                if n >= len(bufs[0]):
                    n -= len(bufs.pop(0))
                else:
                    bufs[0] = bufs[0][n:]
                    n = 0

    def _pump(self) -> None:
        """Receive once and handle every complete PDU."""
        # The rest of a large data PDU in one call (MSG_WAITALL: the kernel gathers it and
        # wakes us once); otherwise whatever has arrived, headers first.
        flags = socket.MSG_WAITALL if self._qp.data_remaining > WAITALL_BYTES_MIN else 0
        n = self._sock.recv_into(self._qp.get_buffer(), 0, flags)
        if n == 0:
            raise NvmeTransportError(f"{self.peer} closed the connection")
        self._qp.buffer_updated(n)
        while True:
            ev = self._qp.next_event()
            if isinstance(ev, CapsuleResp):
                self._complete(ev.cqe.cid, ev.cqe)
            elif isinstance(ev, C2HData):
                req = self._inflight[ev.cccid]  # the sink checked it
                req.received += len(ev.data)
                req.bad |= not ev.ddgst_ok
                if ev.success:
                    self._complete(ev.cccid, Cqe(cid=ev.cccid, sqid=self.qid))
            elif isinstance(ev, R2T):
                self._r2t(ev)
            elif isinstance(ev, C2HTermReq):
                raise NvmeTransportError(
                    f"target terminated the connection: FES {ev.fes:#x}, FEI {ev.fei}"
                )
            else:
                return

    def _complete(self, cid: int, cqe: Cqe) -> None:
        req = self._inflight.pop(cid, None)
        if req is None:
            raise RemoteProtocolError(
                f"completion for cid {cid}, which is not outstanding",
                fes=Fes.INVALID_PDU_HEADER_FIELD,
                fei=8,
            )
        if req.bad and cqe.ok:
            cqe = Cqe.error(cid=cid, status=Status.TRANSIENT_TRANSPORT_ERROR, dnr=False)
        elif (
            cqe.ok
            and req.data_in is not None
            and req.received != len(req.data_in)
            and not req.partial_ok
        ):
            # success without all the data: never hand back a half-filled buffer as read
            cqe = Cqe.error(cid=cid, status=Status.DATA_TRANSFER_ERROR, cdw0=req.received)
        req.cqe = cqe
        self._free_cids.append(cid)
        self._done += 1

    def _sink(self, ptype: PduType, cid: int, ttag: int, offset: int, length: int) -> memoryview:
        req = self._inflight.get(cid)
        if req is None or req.data_in is None:
            raise RemoteProtocolError(
                f"C2HData for cid {cid}, which expects none",
                fes=Fes.INVALID_PDU_HEADER_FIELD,
                fei=8,
            )
        if offset + length > len(req.data_in):
            raise RemoteProtocolError(
                f"C2HData {offset}+{length} beyond {len(req.data_in)}",
                fes=Fes.DATA_TRANSFER_OUT_OF_RANGE,
                fei=12,
            )
        return req.data_in[offset : offset + length]

    def _r2t(self, ev: R2T) -> None:
        req = self._inflight.get(ev.cccid)
        data = req.data_out if req is not None else None
        if data is None or ev.r2to + ev.r2tl > len(data):
            raise RemoteProtocolError(
                f"R2T {ev.r2to}+{ev.r2tl} for cid {ev.cccid} out of range",
                fes=Fes.DATA_TRANSFER_OUT_OF_RANGE,
                fei=12,
            )
        end = ev.r2to + ev.r2tl
        step = self.maxh2cdata
        for off in range(ev.r2to, end, step):
            chunk = data[off : min(off + step, end)]
            last = off + len(chunk) == end
            self._send(
                self._qp.send(
                    H2CData(cccid=ev.cccid, ttag=ev.ttag, datao=off, data=chunk, last=last)
                )
            )
