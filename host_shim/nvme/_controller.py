"""NvmeTcpController: a userspace NVMe/TCP host (admin queue + N I/O queues).

Connect follows what Linux and SPDK hosts do: ICReq/ICResp, Fabrics Connect on the admin
queue (dynamic controller, KATO), CAP, CC.EN = 1 and wait for CSTS.RDY, Identify Controller,
Set Features Number of Queues, then one TCP connection per I/O queue with its own Connect.

Large I/O is split into commands of at most the controller's MDTS (or `max_transfer_bytes`)
and spread over the I/O queues, each keeping up to `queue_depth` commands in flight. All
methods are thread-safe: each queue pair has a lock, and a caller takes a free queue if one is.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from host_shim.nvme._auth import DhchapOptions, authenticate, needs_auth
from host_shim.nvme._errors import NvmeError, NvmeStatusError, NvmeTransportError
from host_shim.nvme._queue import QueuePairSocket, Request
from host_shim.nvme._tls import tls_wrapper
from kvproto.nvme import (
    CONNECT_DATA_BYTES,
    DISCOVERY_ENTRY_BYTES,
    DISCOVERY_HEADER_BYTES,
    DISCOVERY_NQN,
    IDENTIFY_BYTES,
    Cns,
    ConnectData,
    Cqe,
    DiscoveryEntry,
    DiscoveryLog,
    DsmRange,
    FeatureId,
    IdentifyController,
    IdentifyNamespace,
    LogPageId,
    Property,
    Sqe,
)
from kvproto.nvme import _commands as cmds

__all__ = ["NvmeTcpController", "discover"]

NLB_MAX = 65536  # blocks in one Read/Write/Write Zeroes (NLB is a 16-bit 0's based field)
TRANSFER_BYTES_DEFAULT_MAX = 4 << 20  # when the controller reports no MDTS limit
READY_TIMEOUT_S_MAX = 30.0  # waiting for CSTS.RDY after CC.EN = 1 (CAP.TO, bounded)
DISCOVERY_RETRIES_MAX = 8  # re-reads of the discovery log while its genctr keeps changing
_CC_EN_IOSQES_IOCQES = 0x1 | (6 << 16) | (4 << 20)
_CC_SHN_NORMAL = 1 << 14
_CSTS_SHST_MASK = 0x3 << 2
_CSTS_SHST_COMPLETE = 0x2 << 2
# Waiting for CSTS.SHST = complete after CC.SHN on close: Linux's default shutdown_timeout
# (5 s); SPDK's target reports it within milliseconds, and busy-loops ~100 ms per close when
# the host hangs up before it has.
SHUTDOWN_TIMEOUT_S_MAX = 5.0
SHUTDOWN_POLL_S = 0.002  # first poll interval; doubles up to 50 ms


def default_hostnqn() -> str:
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"


def _byte_view(buf: Any, *, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read buffer must be writable")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class NvmeTcpController:
    """A connected NVMe controller; build with `NvmeTcpController.connect(...)`."""

    def __init__(
        self,
        *,
        admin: QueuePairSocket,
        subnqn: str,
        hostnqn: str,
        hostid: bytes,
        kato_ms: int,
        max_transfer_bytes: int | None,
    ) -> None:
        """Use `connect()`; this only holds the state."""
        self._admin = admin
        self._io: list[QueuePairSocket] = []
        self.cntlid = 0
        self.subnqn = subnqn
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.kato_ms = kato_ms
        self.ident: IdentifyController | None = None
        self._max_transfer_wanted = max_transfer_bytes
        self.max_transfer_bytes = max_transfer_bytes or TRANSFER_BYTES_DEFAULT_MAX
        self._ns_block_size: dict[int, int] = {}
        self._rr = itertools.count()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self.dhchap: DhchapOptions | None = None  # DH-HMAC-CHAP keys (docs/NVME_AUTH.md)
        self._tls: Callable[[socket.socket], Any] | None = None  # secure channel wrapper

    # -- connect / close ------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        subnqn: str,
        hostnqn: str | None = None,
        *,
        io_queues: int = 1,
        queue_depth: int = 32,
        admin_queue_depth: int = 32,
        kato_ms: int = 10000,
        keep_alive: bool = True,
        hdgst: bool = False,
        ddgst: bool = False,
        timeout_s: float = 30.0,
        max_transfer_bytes: int | None = None,
        hostid: bytes | None = None,
        dhchap_key: Any = None,
        dhchap_ctrlr_key: Any = None,
        dhchap_hashes: Sequence[Any] | None = None,
        dhchap_dhgroups: Sequence[Any] | None = None,
        psk: Any = None,
    ) -> NvmeTcpController:
        """Connect to `subnqn` at host:port with `io_queues` I/O queues of `queue_depth`.

        `max_transfer_bytes` caps the bytes per command below the controller's MDTS.
        `dhchap_key`/`dhchap_ctrlr_key` (DhchapSecret or `DHHC-1:` string): DH-HMAC-CHAP on
        every queue, bidirectional with a controller key (docs/NVME_AUTH.md).
        `psk` (TlsPsk or `NVMeTLSkey-1:` string): every queue over TLS 1.3 (secure channel).
        """
        tls = None
        dhchap = (
            DhchapOptions.build(dhchap_key, dhchap_ctrlr_key, dhchap_hashes, dhchap_dhgroups)
            if dhchap_key is not None or dhchap_ctrlr_key is not None
            else None
        )
        if queue_depth < 2 or admin_queue_depth < 2:
            raise ValueError("queue depths must be >= 2 (SQSIZE is 0's based and must be >= 1)")
        hostnqn = hostnqn or default_hostnqn()
        hostid = hostid or uuid.uuid5(uuid.NAMESPACE_URL, hostnqn).bytes
        if psk is not None:
            tls = tls_wrapper(psk, hostnqn, subnqn)
        admin = QueuePairSocket(
            host,
            port,
            qid=0,
            depth=admin_queue_depth,
            timeout_s=timeout_s,
            hdgst=hdgst,
            ddgst=ddgst,
            tls=tls,
        )
        ctrl = cls(
            admin=admin,
            subnqn=subnqn,
            hostnqn=hostnqn,
            hostid=hostid,
            kato_ms=kato_ms,
            max_transfer_bytes=max_transfer_bytes,
        )
        ctrl.dhchap = dhchap
        ctrl._tls = tls
        try:
            ctrl._start_admin(timeout_s)
            if subnqn != DISCOVERY_NQN and io_queues:
                ctrl._start_io(host, port, io_queues, queue_depth, timeout_s, hdgst, ddgst)
        except BaseException:
            for q in [admin, *ctrl._io]:
                q.close()
            raise
        if keep_alive and kato_ms:
            ctrl._start_keep_alive()
        return ctrl

    def _connect_data(self, cntlid: int) -> ConnectData:
        return ConnectData(
            hostid=self.hostid, cntlid=cntlid, subnqn=self.subnqn, hostnqn=self.hostnqn
        )

    def _start_admin(self, timeout_s: float) -> None:
        """Connect the admin queue, enable the controller, learn its limits."""
        cqe = _connect_queue(self._admin, self._connect_data(0xFFFF), self.kato_ms)
        self.cntlid = cqe.cdw0 & 0xFFFF
        self._authenticate(self._admin, cqe)
        self._enable(timeout_s)
        self.ident = ident = self.identify_controller()
        limit = 4096 << ident.mdts if ident.mdts else TRANSFER_BYTES_DEFAULT_MAX
        self.max_transfer_bytes = min(limit, self._max_transfer_wanted or limit)

    def _start_io(
        self,
        host: str,
        port: int,
        count: int,
        depth: int,
        timeout_s: float,
        hdgst: bool,
        ddgst: bool,
    ) -> None:
        """Set Features Number of Queues, then one connection per I/O queue."""
        cqe = self._admin_cmd(
            lambda c: cmds.set_features(
                cid=c, fid=FeatureId.NUMBER_OF_QUEUES, cdw11=(count - 1) | (count - 1) << 16
            ),
            "Set Features (Number of Queues)",
        )
        granted = min(count, (cqe.cdw0 & 0xFFFF) + 1, (cqe.cdw0 >> 16) + 1)
        assert self.ident is not None
        icd = max(0, self.ident.ioccsz * 16 - 64) if self.ident.ioccsz else 0
        for qid in range(1, granted + 1):
            q = QueuePairSocket(
                host,
                port,
                qid=qid,
                depth=depth,
                timeout_s=timeout_s,
                hdgst=hdgst,
                ddgst=ddgst,
                tls=self._tls,
            )
            self._io.append(q)
            q.icd_bytes = icd
            self._authenticate(q, _connect_queue(q, self._connect_data(self.cntlid), 0))
        if len(self._io) > 1:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                len(self._io), thread_name_prefix="nvme-tcp"
            )

    def _authenticate(self, q: QueuePairSocket, cqe: Cqe, *, force: bool = False) -> None:
        if force or needs_auth(cqe, self.dhchap):
            authenticate(q, self.dhchap, hostnqn=self.hostnqn, subnqn=self.subnqn)

    def reauthenticate(self) -> None:
        """A new DH-HMAC-CHAP transaction on every queue (NVMe 8.13.5.8 re-authentication).
        Raises NvmeAuthError if the controller refuses, NvmeStatusError if it does not
        support re-authentication (older SPDK targets answer Command Sequence Error)."""
        for q in [self._admin, *self._io]:  # I/O may continue meanwhile (the spec allows it)
            self._authenticate(q, Cqe(cid=0), force=True)

    def _enable(self, timeout_s: float) -> None:
        cap = self.property_get(Property.CAP)
        self.property_set(Property.CC, _CC_EN_IOSQES_IOCQES)
        deadline = time.monotonic() + min(
            READY_TIMEOUT_S_MAX, max(timeout_s, (cap >> 24 & 0xFF) * 0.5)
        )
        while not self.property_get(Property.CSTS) & 0x1:
            if time.monotonic() > deadline:
                raise NvmeTransportError(f"controller {self.cntlid} not ready after CC.EN = 1")
            time.sleep(0.01)

    def close(self) -> None:
        """Shut the controller down (CC.SHN) and close every connection. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=5)
        if self._admin.broken:  # nobody to tell: the handshake would only wait on a timeout
            self.abort()
            return
        try:
            self._shutdown()
        except NvmeError:
            pass  # best effort: the target may be gone already
        for q in [*self._io, self._admin]:
            q.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Close every connection now, without the shutdown handshake: for a controller whose
        target stopped answering, where close() would wait on the dead admin queue (its
        timeout per command). The target frees the controller when its keep-alive timer
        expires. Never blocks on the peer, on a queue's lock or on the keep-alive thread (it
        ends on its own when its command fails). Idempotent."""
        self._closed.set()
        for q in [*self._io, self._admin]:
            q.abort()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _shutdown(self) -> None:
        """CC.SHN = normal, then poll CSTS.SHST until the controller reports the shutdown
        complete (as Linux does), at most SHUTDOWN_TIMEOUT_S_MAX."""
        self.property_set(Property.CC, _CC_EN_IOSQES_IOCQES | _CC_SHN_NORMAL)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S_MAX
        pause = SHUTDOWN_POLL_S
        while self.property_get(Property.CSTS) & _CSTS_SHST_MASK != _CSTS_SHST_COMPLETE:
            if time.monotonic() + pause > deadline:
                return  # the controller is slow or gone: close anyway
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def __enter__(self) -> NvmeTcpController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def io_queue_count(self) -> int:
        return len(self._io)

    # -- keep-alive -----------------------------------------------------------------------

    def _start_keep_alive(self) -> None:
        period_s = self.kato_ms / 2000

        def run() -> None:
            while not self._closed.wait(period_s):
                try:
                    self.keep_alive()
                except NvmeError:
                    return  # the admin queue is gone; the next command will say so

        self._ka_thread = threading.Thread(target=run, name="nvme-keep-alive", daemon=True)
        self._ka_thread.start()

    def keep_alive(self) -> None:
        self._admin_cmd(lambda c: cmds.keep_alive(cid=c), "Keep Alive")

    # -- admin ----------------------------------------------------------------------------

    def _admin_cmd(
        self, make: Callable[[int], Sqe], what: str, *, data_in: memoryview | None = None
    ) -> Cqe:
        req = Request(make, what=what, data_in=data_in)
        self._admin.execute([req])
        assert req.cqe is not None
        if not req.cqe.ok:
            raise NvmeStatusError(what, req.cqe)
        return req.cqe

    def property_get(self, prop: Property) -> int:
        cqe = self._admin_cmd(
            lambda c: cmds.property_get(cid=c, prop=prop), f"Property Get {prop.name}"
        )
        return cqe.cdw0 | (cqe.cdw1 << 32 if prop.size == 8 else 0)

    def property_set(self, prop: Property, value: int) -> None:
        self._admin_cmd(
            lambda c: cmds.property_set(cid=c, prop=prop, value=value), f"Property Set {prop.name}"
        )

    def identify_controller(self) -> IdentifyController:
        buf = bytearray(IDENTIFY_BYTES)
        self._admin_cmd(
            lambda c: cmds.identify(cid=c, cns=Cns.CONTROLLER),
            "Identify Controller",
            data_in=memoryview(buf),
        )
        return IdentifyController.unpack(buf)

    def identify_namespace(self, nsid: int) -> IdentifyNamespace:
        buf = bytearray(IDENTIFY_BYTES)
        self._admin_cmd(
            lambda c: cmds.identify(cid=c, cns=Cns.NAMESPACE, nsid=nsid),
            f"Identify Namespace {nsid}",
            data_in=memoryview(buf),
        )
        ns = IdentifyNamespace.unpack(buf)
        if ns.nsze:
            self._ns_block_size[nsid] = ns.block_size
        return ns

    def active_namespaces(self) -> list[int]:
        buf = bytearray(IDENTIFY_BYTES)
        self._admin_cmd(
            lambda c: cmds.identify(cid=c, cns=Cns.ACTIVE_NAMESPACES),
            "Identify Active Namespace List",
            data_in=memoryview(buf),
        )
        ids = [int.from_bytes(buf[i : i + 4], "little") for i in range(0, IDENTIFY_BYTES, 4)]
        return [n for n in ids if n] if ids else []

    def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes:
        buf = bytearray(length)
        self._admin_cmd(
            lambda c: cmds.get_log_page(cid=c, lid=lid, length=length, offset=offset),
            f"Get Log Page {lid:#x}",
            data_in=memoryview(buf),
        )
        return bytes(buf)

    def get_features(self, fid: int) -> int:
        return self._admin_cmd(
            lambda c: cmds.get_features(cid=c, fid=fid), f"Get Features {fid:#x}"
        ).cdw0

    def set_features(self, fid: int, value: int) -> int:
        return self._admin_cmd(
            lambda c: cmds.set_features(cid=c, fid=fid, cdw11=value), f"Set Features {fid:#x}"
        ).cdw0

    def discovery_log(self) -> list[DiscoveryEntry]:
        """The discovery log page (on a controller of the discovery subsystem)."""
        for _ in range(DISCOVERY_RETRIES_MAX):
            head = self.get_log_page(LogPageId.DISCOVERY, DISCOVERY_HEADER_BYTES)
            genctr, numrec = DiscoveryLog.record_count(head)
            page = self.get_log_page(
                LogPageId.DISCOVERY, DISCOVERY_HEADER_BYTES + numrec * DISCOVERY_ENTRY_BYTES
            )
            log = DiscoveryLog.unpack(page)
            if log.genctr == genctr:
                return list(log.entries)
        raise NvmeError(f"discovery log kept changing over {DISCOVERY_RETRIES_MAX} reads")

    @classmethod
    def discover(
        cls, host: str, port: int = 8009, hostnqn: str | None = None, **kw: Any
    ) -> list[DiscoveryEntry]:
        """Connect to the discovery subsystem at host:port and return its log entries."""
        with cls.connect(
            host, port, DISCOVERY_NQN, hostnqn, io_queues=0, keep_alive=False, **kw
        ) as ctrl:
            return ctrl.discovery_log()

    # -- I/O ------------------------------------------------------------------------------

    def block_size(self, nsid: int) -> int:
        bs = self._ns_block_size.get(nsid)
        if bs is None:
            ns = self.identify_namespace(nsid)
            if not ns.nsze:
                raise NvmeError(f"namespace {nsid} is not active on {self.subnqn}")
            bs = ns.block_size
        return bs

    def read(self, nsid: int, lba: int, into: Any) -> None:
        """Read len(into) bytes from `lba` straight into `into` (any writable buffer)."""
        view = _byte_view(into, writable=True)
        self._rw(nsid, lba, view, write=False)

    def write(self, nsid: int, lba: int, data: Any) -> None:
        view = _byte_view(data, writable=False)
        self._rw(nsid, lba, view, write=True)

    def _rw(self, nsid: int, lba: int, view: memoryview, *, write: bool) -> None:
        bs = self.block_size(nsid)
        if len(view) % bs or not view:
            raise ValueError(f"I/O of {len(view)} bytes is not a positive multiple of {bs}")
        step = min(self.max_transfer_bytes, NLB_MAX * bs)
        reqs = []
        for off in range(0, len(view), step):
            part = view[off : off + step]
            slba, nlb = lba + off // bs, len(part) // bs
            if write:
                make = _write_maker(nsid, slba, nlb, bs, in_capsule=len(part) <= self._icd)
                reqs.append(
                    Request(make, what=f"Write nsid {nsid} LBA {slba}+{nlb}", data_out=part)
                )
            else:
                make = _read_maker(nsid, slba, nlb, bs)
                reqs.append(Request(make, what=f"Read nsid {nsid} LBA {slba}+{nlb}", data_in=part))
        self._run_io(reqs)

    @property
    def _icd(self) -> int:
        return self._io[0].icd_bytes if self._io else 0

    def flush(self, nsid: int) -> None:
        self._run_io([Request(lambda c: cmds.flush(cid=c, nsid=nsid), what=f"Flush nsid {nsid}")])

    def write_zeroes(self, nsid: int, lba: int, block_count: int) -> None:
        reqs = []
        for off in range(0, block_count, NLB_MAX):
            n = min(NLB_MAX, block_count - off)
            reqs.append(
                Request(
                    _wz_maker(nsid, lba + off, n),
                    what=f"Write Zeroes nsid {nsid} LBA {lba + off}+{n}",
                )
            )
        self._run_io(reqs)

    def deallocate(self, nsid: int, lba: int, block_count: int) -> None:
        """Dataset Management (deallocate) of `block_count` blocks from `lba`."""
        ranges = [
            DsmRange(slba=lba + off, nlb=min(0xFFFFFFFF, block_count - off))
            for off in range(0, block_count, 0xFFFFFFFF)
        ]
        for i in range(0, len(ranges), 256):
            chunk = ranges[i : i + 256]
            data = memoryview(b"".join(r.pack() for r in chunk))

            def make(c: int, n: int = len(chunk), small: bool = len(data) <= self._icd) -> Sqe:
                return cmds.dataset_management(cid=c, nsid=nsid, range_count=n, in_capsule=small)

            self._run_io(
                [
                    Request(
                        make, what=f"Deallocate nsid {nsid} LBA {lba}+{block_count}", data_out=data
                    )
                ]
            )

    def _run_io(self, reqs: Sequence[Request]) -> None:
        if not self._io:
            raise NvmeError(f"controller {self.cntlid} has no I/O queues")
        n = len(self._io)
        if n == 1 or len(reqs) == 1:
            self._pick_queue().execute(reqs)
        else:
            start = next(self._rr)
            groups = [(self._io[(start + i) % n], reqs[i::n]) for i in range(min(n, len(reqs)))]
            assert self._pool is not None
            futs = [self._pool.submit(q.execute, g) for q, g in groups]
            errors = [f.exception() for f in futs]
            for e in errors:
                if e is not None:
                    raise e
        for r in reqs:
            assert r.cqe is not None, r.what
            if not r.cqe.ok:
                raise NvmeStatusError(r.what, r.cqe)

    def _pick_queue(self) -> QueuePairSocket:
        """A queue nobody is using if there is one, else the next in turn."""
        for q in self._io:
            if not q.lock.locked() and not q.broken:
                return q
        return self._io[next(self._rr) % len(self._io)]


def _connect_queue(q: QueuePairSocket, data: ConnectData, kato_ms: int) -> Cqe:
    payload = memoryview(data.pack())
    assert len(payload) == CONNECT_DATA_BYTES

    def make(c: int) -> Sqe:
        return cmds.connect(cid=c, qid=q.qid, sqsize=q.depth - 1, kato_ms=kato_ms, in_capsule=True)

    req = Request(make, what=f"Connect qid {q.qid} to {data.subnqn}", data_out=payload)
    q.execute([req])
    assert req.cqe is not None
    if not req.cqe.ok:
        raise NvmeStatusError(req.what, req.cqe)
    return req.cqe


def _read_maker(nsid: int, slba: int, nlb: int, bs: int) -> Callable[[int], Sqe]:
    return lambda c: cmds.read(cid=c, nsid=nsid, slba=slba, nlb=nlb, block_size=bs)


def _write_maker(
    nsid: int, slba: int, nlb: int, bs: int, *, in_capsule: bool
) -> Callable[[int], Sqe]:
    return lambda c: cmds.write(
        cid=c, nsid=nsid, slba=slba, nlb=nlb, block_size=bs, in_capsule=in_capsule
    )


def _wz_maker(nsid: int, slba: int, nlb: int) -> Callable[[int], Sqe]:
    return lambda c: cmds.write_zeroes(cid=c, nsid=nsid, slba=slba, nlb=nlb)


def discover(
    host: str, port: int = 8009, hostnqn: str | None = None, **kw: Any
) -> list[DiscoveryEntry]:
    """The discovery log of the target at host:port (8009 is the discovery service's port)."""
    return NvmeTcpController.discover(host, port, hostnqn, **kw)
