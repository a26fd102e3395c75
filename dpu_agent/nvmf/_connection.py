"""One NVMe/TCP connection (one queue pair) of the target: an asyncio BufferedProtocol.

The codec (`kvproto.nvme.QueuePair`) parses; this layer owns commands, buffers and the
socket. Received data goes straight into per-queue buffers (`get_buffer` hands the codec's
destination to the event loop), device I/O runs in the target's bounded thread pool, and a
protocol error gets a C2HTermReq and closes this connection only.

Buffers are allocated once per queue (lazily, up to a bound) and reused: in-capsule buffers
(one per queue slot) and data buffers of `max_io_size` (`data_buffers_per_queue`). A buffer
that a C2HData references stays out of the pool until it has been copied out of the cork list
and the transport has sent it (write buffer limits 0/0: `resume_writing` fires exactly when the
transport's buffer drains).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dpu_agent import telemetry
from dpu_agent.blockdev import BlockDevice, BlockDeviceError, MemoryViewDevice
from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.nvmf import _placement as placement
from dpu_agent.nvmf._auth import ATR_BIT, auth_exempt, handle_auth, queue_auth
from dpu_agent.nvmf._controller import Completion, Controller
from dpu_agent.nvmf._limits import (
    ADMIN_REPLY_BYTES_MAX,
    AUTH_DEADLINE_S,
    CONNECT_DEADLINE_S,
    R2T_TIMEOUT_S,
    SEND_QUEUE_BYTES_MAX,
    SizedPool,
)
from dpu_agent.runclock import run_clock
from kvproto.nvme import (
    ADMIN_ICD_BYTES,
    R2T,
    AdminOpcode,
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    ControllerAuth,
    Cqe,
    FabricsType,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    IoOpcode,
    LocalProtocolError,
    PduType,
    QueuePair,
    RemoteProtocolError,
    Role,
    SglType,
    Sqe,
    Status,
)
from kvproto.nvme._errors import Fes

if TYPE_CHECKING:
    from dpu_agent.nvmf._target import NvmeTcpTarget

__all__ = ["ADMIN_ICD_BYTES", "MAXH2CDATA", "MemoryViewDevice", "NvmfConnection"]

log = get_logger("dpu_agent.nvmf")
refusals = RateLimitedLog(log)  # protocol errors of hostile peers: a few lines a second
device_errors = RateLimitedLog(log)  # a full or failing device: a line a few times a second
write_refusals = RateLimitedLog(log)  # a tenant host writing outside its reservations

# MAXH2CDATA in ICResp is max(this, max_io_size). SPDK sends 128 KiB (its
# NVMF_TCP_PDU_MAX_H2C_DATA_SIZE); the spec leaves it to the controller, and one H2CData per
# command costs this event loop far fewer turns than eight.
MAXH2CDATA = 131072
ZEROES = bytes(1 << 20)  # source for Write Zeroes, written in chunks of this size
SOCKET_BUFFER_BYTES = 4 << 20  # asked of the kernel (it caps it at net.core.wmem_max)
# SO_RCVLOWAT while a data PDU is coming in: big enough to amortise a loop turn, at most a
# quarter of the receive buffer (Linux caps it at half), not worth it below 64 KiB.
RCVLOWAT_BYTES_MAX = 1 << 20
RCVLOWAT_BYTES_MIN = 64 << 10
CORK_BYTES_MAX = 8192  # PDUs up to this size wait for the end of the loop turn
# Writes to a page-cache device (the NVMe tier's file) run inline on the loop (`placement.inline`)
# unless one took longer than this: a 1 MiB write and its cipher pass take ~0.2 ms here, so
# 2 ms means the kernel throttles the writer (dirty limits) or the device is slow, and the
# loop serves every queue. The queue then sends its writes to the I/O pool for
# INLINE_BACKOFF_S, and tries inline again after that.
INLINE_WRITE_SLOW_S = 0.002
INLINE_BACKOFF_S = 1.0


class _Pool:
    """Fixed-size bytearrays, allocated on first need up to `count_max`, then reused."""

    __slots__ = ("_free", "allocated", "count_max", "size")

    def __init__(self, size: int, count_max: int) -> None:
        self.size, self.count_max, self.allocated = size, count_max, 0
        self._free: list[bytearray] = []

    def take(self) -> bytearray | None:
        if self._free:
            return self._free.pop()
        if self.allocated < self.count_max:
            self.allocated += 1
            return bytearray(self.size)
        return None

    def has_free(self) -> bool:
        return bool(self._free) or self.allocated < self.count_max

    def give(self, buf: bytearray) -> None:
        assert len(buf) == self.size and len(self._free) < self.allocated, (len(buf), self.size)
        self._free.append(buf)


class _Cmd:
    """One outstanding command on this queue."""

    __slots__ = (
        "bad",
        "buf",
        "dev",
        "h2c_next",
        "icd",
        "in_place",
        "length",
        "nlb",
        "r2t_at",
        "received",
        "slba",
        "sqe",
        "t0",
        "ttag",
        "view",
    )

    def __init__(self, sqe: Sqe) -> None:
        self.sqe = sqe
        self.t0 = time.perf_counter()  # capsule received: the data-path latency starts
        self.buf: bytearray | None = None  # data buffer from the pool
        self.icd: bytearray | None = None  # in-capsule buffer to give back
        self.view = memoryview(b"")
        self.length = 0
        self.received = 0
        self.h2c_next = 0  # offset the next H2CData must start at (checked as it is parsed)
        self.ttag = 0
        self.bad = False  # a data digest failed: complete with a transient transport error
        self.in_place = False  # `view` is the device's memory (MemoryViewDevice)
        self.dev: BlockDevice | None = None
        self.slba = 0
        self.nlb = 0
        self.r2t_at = 0.0  # run_clock() when the R2T went out (R2T_TIMEOUT_S)


class NvmfConnection(asyncio.BufferedProtocol):
    def __init__(self, target: NvmeTcpTarget) -> None:
        self.target = target
        self.opts = target.options
        self.qp = QueuePair(
            Role.CONTROLLER,
            sink=self._sink,
            capsule_data_bytes_max=max(ADMIN_ICD_BYTES, self.opts.in_capsule_data_size),
            data_pdu_bytes_max=max(MAXH2CDATA, self.opts.max_io_size),
        )
        self.transport: asyncio.Transport | None = None
        self._sock: Any = None
        self._fd = -1  # the socket's descriptor for writev of data PDUs; -1: through asyncio
        self._lowat = 1
        self._out: list[bytes | bytearray | memoryview] = []  # corked small PDUs
        self.peer = ""
        self.ctrl: Controller | None = None
        self.qid: int | None = None
        self.auth: ControllerAuth | None = None  # DH-HMAC-CHAP state of this queue (_auth.py)
        self.proven = False  # an I/O queue holding its qid (NvmeTcpTarget.io_queue_proven)
        self.depth = self.opts.max_aq_depth
        self.icd_limit = ADMIN_ICD_BYTES
        self.closed = False
        self._cmds: dict[int, _Cmd] = {}
        self._ttags: dict[int, _Cmd] = {}
        self._next_ttag = 1
        self._sqhd = 0
        self._icd_pool = _Pool(self.qp_icd_bytes, self.opts.max_queue_depth)
        # buffers sized to each command, charged to the controller's budget once connected
        self._data_pool = SizedPool(self.opts.max_io_size, self.opts.data_buffers_per_queue)
        self._waiting: collections.deque[_Cmd] = collections.deque()
        self._unsent: list[bytearray] = []  # buffers the transport may still reference
        self._deadline: asyncio.TimerHandle | None = None  # ICReq + Connect (CONNECT_DEADLINE_S)
        self._auth_timer: asyncio.TimerHandle | None = None  # Connect -> authenticated
        self.auth_busy = False  # a DH step of this queue runs in the target's auth executor
        self._reading_paused = False  # SEND_QUEUE_BYTES_MAX of replies unsent
        self._pool_writes_until = 0.0  # monotonic: an inline write was slow (INLINE_WRITE_SLOW_S)

    @property
    def qp_icd_bytes(self) -> int:
        return max(ADMIN_ICD_BYTES, self.opts.in_capsule_data_size)

    # -- asyncio protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # or uvloop's equivalent
        sock = transport.get_extra_info("socket")
        self._sock = sock
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Room for a whole max_io_size C2HData in the kernel: one send() per PDU, and
            # asyncio need not copy the rest into its own buffer.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.transport.set_write_buffer_limits(high=0, low=0)
        if sock is not None and type(transport).__name__ == "_SelectorSocketTransport":
            # The plain asyncio socket transport (not TLS, whose transport hands out the same
            # socket but must encrypt): data PDUs may go straight to the descriptor.
            self._fd = sock.fileno()
        self._deadline = asyncio.get_running_loop().call_later(
            CONNECT_DEADLINE_S, self._connect_deadline
        )
        self.target.connection_opened(self)

    def _connect_deadline(self) -> None:
        if self.qid is None and not self.closed:  # no Connect yet: a slot held for nothing
            self.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.qp.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.qp.buffer_updated(nbytes)
            while not self.closed:
                ev = self.qp.next_event()
                if isinstance(ev, CapsuleCmd):
                    self._on_capsule(ev)
                elif isinstance(ev, H2CData):
                    self._on_h2c(ev)
                elif isinstance(ev, ICReq):
                    self._write(
                        ICResp(
                            cpda=min(ev.hpda, 31),
                            hdgst=ev.hdgst,
                            ddgst=ev.ddgst,
                            maxh2cdata=max(MAXH2CDATA, self.opts.max_io_size),
                        )
                    )
                elif isinstance(ev, H2CTermReq):
                    log.info("nvmf_h2c_term_req", peer=self.peer, fes=ev.fes, fei=ev.fei)
                    self.close()
                else:
                    break
        except RemoteProtocolError as e:
            self.fatal(e)
            return
        self._set_lowat(self.qp.data_remaining)

    def _set_lowat(self, remaining: int) -> None:
        """Wake the loop only once a large chunk of a data PDU is in (SO_RCVLOWAT).

        Loopback delivers 64 KiB at a time; one loop turn per 64 KiB costs more than the copy.
        """
        lowat = min(remaining, RCVLOWAT_BYTES_MAX) if remaining > RCVLOWAT_BYTES_MIN else 1
        if lowat != self._lowat and self._sock is not None:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def fatal(self, e: RemoteProtocolError) -> None:
        """Answer a protocol error with a C2HTermReq, then close this connection."""
        refusals.warning(
            "nvmf_protocol_error",
            peer=self.peer,
            error=str(e),
            fes=int(e.fes),
            fei=e.fei,
            qid=self.qid,
        )
        if self.transport is not None and not self.closed:
            self._flush()
            try:
                for part in self.qp.term_req(e):
                    self.transport.write(part)
            except LocalProtocolError:
                pass
        self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        """The transport sent everything: buffers it referenced can be reused, and a host
        paused for unread replies (SEND_QUEUE_BYTES_MAX) is read again."""
        self._give_back_unsent()
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        self._start_waiting()

    def _give_back_unsent(self) -> None:
        """Return released data buffers to the pool once no outgoing bytes can reference
        them: nothing corked in `_out` (small PDUs wait there by reference until the end of
        the loop turn) and nothing buffered in the transport."""
        if self._out or not self._unsent:
            return
        assert self.transport is not None
        if self.transport.get_write_buffer_size():
            return  # resume_writing comes when it drains
        unsent, self._unsent = self._unsent, []
        for buf in unsent:
            self._data_pool.give(buf)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._deadline is not None:
            self._deadline.cancel()
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        held = [c.buf for c in self._cmds.values() if c.buf is not None] + self._unsent
        self._data_pool.close(held)
        self._data_pool.budget.unwait(self._start_waiting)
        self._unsent = []
        self._cmds.clear()
        self._ttags.clear()
        self._waiting.clear()
        self.target.connection_closed(self)

    def close(self) -> None:
        if not self.closed:
            self._flush()
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # -- sending --------------------------------------------------------------------------

    def _write(self, pdu: Any) -> None:
        """Send `pdu`. Small PDUs are corked until the end of this loop turn and go out in one
        send(): on loopback each send() wakes the peer, which costs far more than the bytes.
        A PDU with bulk data flushes what is corked and goes out at once, in order.
        """
        assert self.transport is not None
        parts = self.qp.send(pdu)
        if sum(len(p) for p in parts) <= CORK_BYTES_MAX:
            if not self._out:
                asyncio.get_running_loop().call_soon(self._flush)
            self._out.extend(parts)
            return
        if self._fd >= 0 and not self.transport.get_write_buffer_size():
            return self._writev(parts)
        # Bulk data: the header (and whatever small PDUs wait) must not leave as a segment of
        # its own, which would wake the host for 24 bytes: TCP_CORK holds it for the data.
        self._out.append(parts[0])
        if self._sock is not None:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        self._flush()
        for part in parts[1:]:
            self.transport.write(part)
        if self._sock is not None:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        self._bound_send_queue()

    def _write_now(self, pdu: Any) -> None:
        """Send a small PDU at once, after whatever is corked, instead of at the end of the loop
        turn: an R2T, which the host's data waits on. Corked, it waited behind the rest of the
        turn (an inline write's cipher pass, the next data PDU's parse): at 1 MiB QD8 the host
        sat idle 24-30 % of the time waiting for R2Ts, and DRAM-tier writes moved 0.90-0.92 of
        the socket ceiling sent at once vs 0.77-0.78 corked (interleaved A/B under the bench
        lock)."""
        assert self.transport is not None
        parts = self.qp.send(pdu)
        if self._fd >= 0 and not self.transport.get_write_buffer_size():
            return self._writev(parts)
        self._out.extend(parts)
        self._flush()

    def _writev(self, parts: list[bytes | bytearray | memoryview]) -> None:
        """A data PDU, after whatever is corked, in one writev(): one system call instead of
        two send()s and two TCP_CORK toggles, and no segment of its own for the header.

        Only with nothing buffered in the transport (order). What the socket does not take is
        handed to the transport (3.11 copies it; 3.12+ keeps a reference, and `_release` then
        holds the buffer in `_unsent` until the transport has drained).
        """
        assert self.transport is not None
        if self._out:
            parts = [b"".join(self._out), *parts]
            self._out.clear()
        try:
            sent = os.writev(self._fd, parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the transport reports the failure on its own write
            sent = 0
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            self.transport.write(memoryview(part)[sent:] if sent else part)
            sent = 0
        self._bound_send_queue()

    def _flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))  # a copy: corked buffers are free now
        self._out.clear()
        if self._unsent and self.transport is not None:
            self._give_back_unsent()
            if self._waiting and not self._unsent:
                # Not from here: _flush runs inside _write, which must finish its PDU first.
                asyncio.get_running_loop().call_soon(self._start_waiting)
        self._bound_send_queue()

    def _bound_send_queue(self) -> None:
        """Stop reading commands while SEND_QUEUE_BYTES_MAX of replies wait to be sent (a host
        that pipelines without reading its replies); resume_writing reads again."""
        t = self.transport
        if t is None or self._reading_paused or t.is_closing():
            return
        if t.get_write_buffer_size() > SEND_QUEUE_BYTES_MAX:
            self._reading_paused = True
            t.pause_reading()

    def expire_r2t(self, now: float) -> bool:
        """Close the connection if an R2T has waited for its data over R2T_TIMEOUT_S (the
        buffer it pins goes back). Called by the target's periodic loop."""
        for cmd in self._ttags.values():
            if now - cmd.r2t_at > R2T_TIMEOUT_S:
                log.info("nvmf_r2t_timeout", peer=self.peer, qid=self.qid, cid=cmd.sqe.cid)
                self.close()
                return True
        return False

    def _complete(
        self,
        cmd: _Cmd,
        status: Status = Status.SUCCESS,
        cdw0: int = 0,
        cdw1: int = 0,
        dnr: bool = True,
    ) -> None:
        cid = cmd.sqe.cid
        if self.closed or self._cmds.pop(cid, None) is not cmd:
            return
        self._release(cmd)
        self._sqhd = (self._sqhd + 1) % self.depth
        if self.qid:
            _observe_io(cmd)
        if status is Status.SUCCESS:
            cqe = Cqe(cid=cid, cdw0=cdw0, cdw1=cdw1, sqhd=self._sqhd, sqid=self.qid or 0)
        else:
            cqe = Cqe.error(
                cid=cid, status=status, dnr=dnr, cdw0=cdw0, sqhd=self._sqhd, sqid=self.qid or 0
            )
        self._write(CapsuleResp(cqe=cqe))

    def _send_data(
        self, cmd: _Cmd, data: bytes | bytearray | memoryview, cdw0: int = 0, cdw1: int = 0
    ) -> None:
        """C2HData for the whole transfer, then the CapsuleResp unless SUCCESS covers it.

        SPDK sends SUCCESS when c2h_success is on and the completion's dwords 0 and 1 are 0.
        One C2HData carries all the data (<= max_io_size): fewer PDUs, and every initiator
        (Linux, SPDK) accepts any size up to the command's length.
        """
        if self.closed or self._cmds.get(cmd.sqe.cid) is not cmd:
            return
        success = self.opts.c2h_success and cdw0 == 0 and cdw1 == 0
        self._write(C2HData(cccid=cmd.sqe.cid, datao=0, data=data, last=True, success=success))
        if success:
            self._cmds.pop(cmd.sqe.cid)
            self._sqhd = (self._sqhd + 1) % self.depth
            self._release(cmd)
            if self.qid:
                _observe_io(cmd)
        else:
            self._complete(cmd, cdw0=cdw0, cdw1=cdw1)

    def _release(self, cmd: _Cmd) -> None:
        if cmd.icd is not None:
            self._icd_pool.give(cmd.icd)
            cmd.icd = None
        if cmd.ttag:
            self._ttags.pop(cmd.ttag, None)
            cmd.ttag = 0
        if cmd.buf is not None:
            buf, cmd.buf, cmd.view = cmd.buf, None, memoryview(b"")
            assert self.transport is not None
            # A corked C2HData (in `_out`) or the transport may still reference `buf`: the
            # pool gets it back after the flush (given back earlier, SPDK's bdevperf read another
            # command's bytes when the next read decrypted into it before the flush).
            if self._out or self.transport.get_write_buffer_size():
                self._unsent.append(buf)
            else:
                self._data_pool.give(buf)
                self._start_waiting()

    # -- receiving ------------------------------------------------------------------------

    def _sink(self, ptype: PduType, cid: int, ttag: int, offset: int, length: int) -> memoryview:
        if ptype is PduType.CAPSULE_CMD:
            buf = self._icd_pool.take()
            if buf is None:
                raise RemoteProtocolError(
                    f"more than {self.depth} commands outstanding",
                    fes=Fes.INVALID_PDU_HEADER_FIELD,
                    fei=10,
                )
            return memoryview(buf)[:length]
        cmd = self._ttags.get(ttag)
        if cmd is None or cmd.sqe.cid != cid:
            raise RemoteProtocolError(
                f"H2CData for unknown ttag {ttag} / cccid {cid}",
                fes=Fes.INVALID_PDU_HEADER_FIELD,
                fei=10,
            )
        if offset != cmd.h2c_next:  # SPDK: data must arrive in order
            raise RemoteProtocolError(
                f"H2CData datao {offset}, expected {cmd.h2c_next}",
                fes=Fes.DATA_TRANSFER_OUT_OF_RANGE,
                fei=12,
            )
        if offset + length > cmd.length:
            raise RemoteProtocolError(
                f"H2CData {offset}+{length} beyond R2T of {cmd.length}",
                fes=Fes.DATA_TRANSFER_OUT_OF_RANGE,
                fei=16,
            )
        cmd.h2c_next = offset + length
        return cmd.view[offset : offset + length]

    def _on_capsule(self, ev: CapsuleCmd) -> None:
        sqe = ev.sqe
        cmd = _Cmd(sqe)
        if ev.data:
            icd = ev.data.obj if isinstance(ev.data, memoryview) else None
            cmd.icd = icd if isinstance(icd, bytearray) else None
        if len(self._cmds) >= self.depth:
            if cmd.icd is not None:
                self._icd_pool.give(cmd.icd)
            raise RemoteProtocolError(
                f"more than {self.depth} commands outstanding",
                fes=Fes.INVALID_PDU_HEADER_FIELD,
                fei=10,
            )
        if sqe.cid in self._cmds and not self._drop_abandoned_aer(sqe.cid):
            if cmd.icd is not None:
                self._icd_pool.give(cmd.icd)
            raise RemoteProtocolError(
                f"command id {sqe.cid} already outstanding",
                fes=Fes.INVALID_PDU_HEADER_FIELD,
                fei=10,
            )
        self._cmds[sqe.cid] = cmd
        if not ev.ddgst_ok:
            return self._complete(cmd, Status.TRANSIENT_TRANSPORT_ERROR, dnr=False)
        if len(ev.data) > self.icd_limit or (ev.data and len(ev.data) != sqe.sgl.length):
            return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        if self.auth is not None and not self.auth.authenticated:
            if not auth_exempt(sqe):  # refused: shows nothing about the host, no keep-alive
                return self._complete(cmd, Status.AUTHENTICATION_REQUIRED)
        elif self.ctrl is not None:
            self.ctrl.keep_alive()  # any accepted command shows the host is alive
        if sqe.opcode == AdminOpcode.FABRICS:
            return self._fabrics(cmd, ev.data)
        if self.qid is None or self.ctrl is None:
            return self._complete(cmd, Status.COMMAND_SEQUENCE_ERROR)
        if self.qid == 0:
            return self._admin(cmd, ev.data)
        return self._io(cmd, ev.data)

    def _on_h2c(self, ev: H2CData) -> None:
        cmd = self._ttags[ev.ttag]  # the sink checked it
        cmd.received += len(ev.data)
        cmd.bad |= not ev.ddgst_ok
        if cmd.received < cmd.length:
            return
        self._ttags.pop(cmd.ttag, None)
        cmd.ttag = 0
        if cmd.bad:
            return self._complete(cmd, Status.TRANSIENT_TRANSPORT_ERROR, dnr=False)
        self._data_ready(cmd, cmd.view)

    # -- Fabrics and admin ----------------------------------------------------------------

    def _fabrics(self, cmd: _Cmd, data: bytes | bytearray | memoryview) -> None:
        fctype = cmd.sqe.fctype
        if fctype == FabricsType.CONNECT:
            return self.target.connect(self, cmd, data)
        if fctype in (FabricsType.AUTH_SEND, FabricsType.AUTH_RECV):
            return handle_auth(self, cmd, data)
        if self.ctrl is None:
            return self._complete(cmd, Status.COMMAND_SEQUENCE_ERROR)
        if fctype in (FabricsType.PROPERTY_GET, FabricsType.PROPERTY_SET) and self.qid == 0:
            done, reset = self.ctrl.fabrics_property(cmd.sqe)
            self._complete(cmd, done.status, done.cdw0, done.cdw1)
            if reset:
                self.target.reset_io_queues(self.ctrl)
            return
        if fctype == FabricsType.DISCONNECT:
            self._complete(cmd)
            return self.close()
        return self._complete(cmd, Status.INVALID_OPCODE)

    def connect_done(self, cmd: _Cmd, ctrl: Controller, qid: int) -> None:
        self.ctrl, self.qid = ctrl, qid
        self._data_pool.attach(ctrl.buffers)  # one buffer budget for all its queues
        self.target.connection_connected(self)
        self.depth = (cmd.sqe.cdw11 & 0xFFFF) + 1
        self._sqhd = 0
        if qid:
            self.icd_limit = self.opts.in_capsule_data_size
        self.auth = queue_auth(ctrl)
        if self.auth is not None:  # the host has AUTH_DEADLINE_S to prove its key
            self._auth_timer = asyncio.get_running_loop().call_later(
                AUTH_DEADLINE_S, self._auth_deadline
            )
        self._complete(cmd, cdw0=ctrl.cntlid | (ATR_BIT if self.auth else 0))

    def _auth_deadline(self) -> None:
        if self.closed or self.auth is None or self.auth.authenticated:
            return
        refusals.warning("nvmf_auth_deadline", peer=self.peer, qid=self.qid,
                         deadline_s=AUTH_DEADLINE_S)  # fmt: skip
        self.close()

    def connect_refused(self, cmd: _Cmd, status: Status, iattr: int = 0, ipo: int = 0) -> None:
        self._complete(cmd, status, cdw0=iattr | ipo << 16)

    def _admin(self, cmd: _Cmd, data: bytes | bytearray | memoryview) -> None:
        assert self.ctrl is not None
        done: Completion = self.ctrl.admin(cmd.sqe, data)
        if done.hold:
            return
        if done.status is not Status.SUCCESS or done.data is None:
            return self._complete(cmd, done.status, done.cdw0)
        length = cmd.sqe.sgl.length
        if (
            cmd.sqe.sgl.type != SglType.TRANSPORT_DATA_BLOCK
            or not 0 < length <= self.opts.max_io_size
        ):
            return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        # what the reply carries (zero-padded to one 4 KiB structure at most), never the
        # SGL's length: a 4 MiB SGL on an Identify gets 4 KiB
        out = done.data[:length]
        out += bytes(max(0, min(length, ADMIN_REPLY_BYTES_MAX) - len(out)))
        self._send_data(cmd, out, done.cdw0)

    def _drop_abandoned_aer(self, cid: int) -> bool:
        """A host reusing the id of an AER we hold has given that AER up: SPDK's initiator
        completes its AERs locally when it detaches and reuses their ids for the shutdown
        Property Get/Set (SPDK's target accepts it). Forget the AER; True if there was one."""
        if self.qid != 0 or self.ctrl is None or cid not in self.ctrl.aer_cids:
            return False
        self.ctrl.aer_cids.remove(cid)
        old = self._cmds.pop(cid)
        self._release(old)
        self._sqhd = (self._sqhd + 1) % self.depth  # it was consumed from the SQ
        return True

    def complete_aers(self) -> None:
        """Drop held AERs when the controller goes (their CQEs would go nowhere)."""
        if self.ctrl is not None:
            for cid in self.ctrl.aer_cids:
                self._cmds.pop(cid, None)
            self.ctrl.aer_cids.clear()

    # -- I/O commands ---------------------------------------------------------------------

    def _io(self, cmd: _Cmd, data: bytes | bytearray | memoryview) -> None:
        assert self.ctrl is not None and self.ctrl.subsystem is not None
        sqe = cmd.sqe
        op = sqe.opcode
        dev = self.ctrl.subsystem.namespaces.get(sqe.nsid)
        if op not in _IO_OPS:
            return self._complete(cmd, Status.INVALID_OPCODE)
        if dev is None:
            return self._complete(cmd, Status.INVALID_NAMESPACE)
        cmd.dev = dev
        if op == IoOpcode.FLUSH:
            return self._submit(cmd, dev.flush)
        if op == IoOpcode.DATASET_MANAGEMENT:
            return self._dsm(cmd, dev, data)
        cmd.slba = sqe.cdw10 | sqe.cdw11 << 32
        cmd.nlb = (sqe.cdw12 & 0xFFFF) + 1
        if cmd.slba + cmd.nlb > dev.block_count:
            return self._complete(cmd, Status.LBA_OUT_OF_RANGE)
        if op != IoOpcode.READ and not self._may_write(sqe.nsid, [(cmd.slba, cmd.nlb)]):
            return self._complete(cmd, Status.ACCESS_DENIED)
        if op == IoOpcode.WRITE_ZEROES:
            return self._submit(cmd, _write_zeroes, dev, cmd.slba, cmd.nlb)
        cmd.length = cmd.nlb * dev.block_size
        sgl = sqe.sgl
        if sgl.length > self.opts.max_io_size:  # SPDK: "SGL length exceeds max io size"
            return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        if sgl.length < cmd.length:
            return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        if op == IoOpcode.WRITE and sgl.type == SglType.DATA_BLOCK_OFFSET:
            if len(data) < cmd.length:  # in-capsule SGL without (enough) in-capsule data
                return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
            return self._data_ready(cmd, memoryview(data)[: cmd.length])
        if sgl.type != SglType.TRANSPORT_DATA_BLOCK:
            return self._complete(cmd, Status.SGL_DESCRIPTOR_TYPE_INVALID)
        self._with_buffer(cmd)

    def _dsm(self, cmd: _Cmd, dev: BlockDevice, data: bytes | bytearray | memoryview) -> None:
        count = (cmd.sqe.cdw10 & 0xFF) + 1
        if not cmd.sqe.cdw11 & 0x4:  # only deallocate does anything
            return self._complete(cmd)
        if len(data) < count * 16:
            return self._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        ranges = _dsm_ranges(data, count)
        if any(s + n > dev.block_count for s, n in ranges):
            return self._complete(cmd, Status.LBA_OUT_OF_RANGE)
        if not self._may_write(cmd.sqe.nsid, ranges):
            return self._complete(cmd, Status.ACCESS_DENIED)
        self._submit(cmd, _deallocate, dev, ranges)

    def _may_write(self, nsid: int, ranges: list[tuple[int, int]]) -> bool:
        """The subsystem's write gate (the agent's tenants: only their open reservations)."""
        assert self.ctrl is not None and self.ctrl.subsystem is not None
        gate = self.ctrl.subsystem.write_gate
        if gate is None or all(gate(nsid, s, n) for s, n in ranges):
            return True
        write_refusals.warning("nvmf_write_outside_reservation", peer=self.peer, nsid=nsid,
                               lba=ranges[0][0], blocks=ranges[0][1])  # fmt: skip
        return False

    def _can_start(self, cmd: _Cmd) -> bool:
        """A data buffer is free (unless the device lends its memory), and for a read the
        transport has sent everything: reading more while it still buffers data would only
        make asyncio copy it (backpressure)."""
        assert self.transport is not None and cmd.dev is not None
        if not placement.lends_memory(cmd.dev) and not self._data_pool.can_take(cmd.length):
            return False
        return cmd.sqe.opcode != IoOpcode.READ or not self.transport.get_write_buffer_size()

    def _with_buffer(self, cmd: _Cmd) -> None:
        if self._waiting or not self._can_start(cmd):
            self._waiting.append(cmd)
            self._data_pool.wait(self._start_waiting, cmd.length)  # another queue may free
            return
        self._start(cmd)

    def _start(self, cmd: _Cmd) -> None:
        dev = cmd.dev
        assert dev is not None
        if placement.lends_memory(dev):  # zero copy: the device's own memory
            cmd.view, cmd.in_place = cast(MemoryViewDevice, dev).view(cmd.slba, cmd.nlb), True
            assert len(cmd.view) == cmd.length and not cmd.view.readonly, len(cmd.view)
            if cmd.sqe.opcode == IoOpcode.READ:
                return self._send_data(cmd, cmd.view)
        else:
            buf = self._data_pool.take(cmd.length)
            assert buf is not None, cmd.length
            cmd.buf, cmd.view = buf, memoryview(buf)[: cmd.length]
            if cmd.sqe.opcode == IoOpcode.READ:
                return self._submit(cmd, dev.read_into, cmd.slba, cmd.view)
        ttag = self._next_ttag
        while ttag in self._ttags or ttag == 0:
            ttag = (ttag + 1) & 0xFFFF
        self._next_ttag = (ttag + 1) & 0xFFFF
        cmd.ttag = ttag
        cmd.r2t_at = run_clock()
        self._ttags[ttag] = cmd
        # One R2T for the whole transfer (as SPDK); the host splits it by MAXH2CDATA.
        self._write_now(R2T(cccid=cmd.sqe.cid, ttag=ttag, r2to=0, r2tl=cmd.length))

    def _start_waiting(self) -> None:
        while self._waiting and not self.closed and self._can_start(self._waiting[0]):
            self._start(self._waiting.popleft())
        if not self._waiting or self.closed:
            self._data_pool.budget.unwait(self._start_waiting)
        else:  # wait where the room is short now (this controller, its host, tenant, target)
            self._data_pool.wait(self._start_waiting, self._waiting[0].length)

    def _data_ready(self, cmd: _Cmd, view: memoryview) -> None:
        assert cmd.dev is not None
        # the gate again: the reservation may have been committed, aborted or expired since
        # the command came (up to R2T_TIMEOUT_S), and its blocks be a chunk or free by now
        if not self._may_write(cmd.sqe.nsid, [(cmd.slba, cmd.nlb)]):
            return self._complete(cmd, Status.ACCESS_DENIED)  # (in place: landed, refused)
        if cmd.in_place:  # the H2CData went straight into the device
            return self._complete(cmd)
        self._submit(cmd, cmd.dev.write, cmd.slba, view)

    def _submit(self, cmd: _Cmd, fn: Callable[..., None], *args: Any) -> None:
        """Run device I/O: inline where a thread hop costs more than it saves, memory work on
        the memory lane, everything else in the target's bounded pool so a slow device or a
        256 MiB Write Zeroes never blocks the loop (nvmf/_placement.py)."""
        op, dev = cmd.sqe.opcode, cmd.dev
        assert dev is not None
        if placement.inline(dev, op):
            guarded = placement.page_cache_write(dev, op)
            if not guarded or time.monotonic() >= self._pool_writes_until:
                t0 = time.perf_counter()
                try:
                    fn(*args)
                except Exception as e:
                    return self._io_done(cmd, e)
                if guarded and time.perf_counter() - t0 > INLINE_WRITE_SLOW_S:
                    self._pool_writes_until = time.monotonic() + INLINE_BACKOFF_S
                return self._io_done(cmd, None)
        memory = placement.memory_lane(dev, op)
        self.target.submit_io(lambda exc: self._io_done(cmd, exc), fn, *args, memory=memory)

    def _io_done(self, cmd: _Cmd, exc: BaseException | None) -> None:
        if self.closed:
            return
        if exc is not None:
            if isinstance(exc, BlockDeviceError):  # a full disk, an I/O error: say so
                device_errors.warning("nvmf_io_device_error", peer=self.peer,
                                      opcode=cmd.sqe.opcode, error=str(exc))  # fmt: skip
            else:
                log.error("nvmf_io_failed", peer=self.peer, opcode=cmd.sqe.opcode, error=repr(exc))
            return self._complete(cmd, Status.INTERNAL_DEVICE_ERROR)
        if cmd.sqe.opcode == IoOpcode.READ:
            return self._send_data(cmd, cmd.view)
        self._complete(cmd)


_IO_OPS = frozenset(
    {
        IoOpcode.FLUSH,
        IoOpcode.WRITE,
        IoOpcode.READ,
        IoOpcode.WRITE_ZEROES,
        IoOpcode.DATASET_MANAGEMENT,
    }
)


_GET = telemetry.child("get", "nvme-tcp")  # chunk reads and writes: data-path latency
_PUT = telemetry.child("put", "nvme-tcp")


def _observe_io(cmd: _Cmd) -> None:
    op = cmd.sqe.opcode
    if op == IoOpcode.READ:
        _GET.observe(time.perf_counter() - cmd.t0)
    elif op == IoOpcode.WRITE:
        _PUT.observe(time.perf_counter() - cmd.t0)


def _dsm_ranges(data: bytes | bytearray | memoryview, count: int) -> list[tuple[int, int]]:
    view = memoryview(data)
    out = []
    for i in range(count):
        rec = view[i * 16 : i * 16 + 16]
        nlb = int.from_bytes(rec[4:8], "little")
        slba = int.from_bytes(rec[8:16], "little")
        if nlb:
            out.append((slba, nlb))
    return out


def _write_zeroes(dev: BlockDevice, slba: int, nlb: int) -> None:
    step = len(ZEROES) // dev.block_size
    for lba in range(slba, slba + nlb, step):
        n = min(step, slba + nlb - lba)
        dev.write(lba, memoryview(ZEROES)[: n * dev.block_size])


def _deallocate(dev: BlockDevice, ranges: list[tuple[int, int]]) -> None:
    for slba, nlb in ranges:
        dev.deallocate(slba, nlb)
