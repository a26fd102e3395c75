"""One NVMe controller of the target: properties, admin commands, keep-alive (no I/O here).

The connection layer hands admin SQEs (with their in-capsule data) to `Controller.admin()` and
sends back the `Completion` it returns; I/O commands are the connection's own business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from dpu_agent.blockdev import BLOCK_SIZE
from dpu_agent.nvmf._limits import ADMIN_REPLY_BYTES_MAX, KATO_IDLE_MS, BufferBudget
from dpu_agent.nvmf._subsystem import Subsystem, TargetOptions, namespace_ids
from kvproto.nvme import (
    IDENTIFY_BYTES,
    AdminOpcode,
    Cns,
    FabricsType,
    FeatureId,
    IdentifyController,
    IdentifyNamespace,
    LogPageId,
    Property,
    Sqe,
    Status,
    ns_id_descriptors,
)
from kvproto.nvme._structs import CNTRLTYPE_DISCOVERY, CNTRLTYPE_IO

__all__ = ["CNTLID_MAX", "CNTLID_MIN", "Completion", "Controller"]

CNTLID_MIN = 1  # SPDK's min_cntlid / max_cntlid defaults
CNTLID_MAX = 0xFFEF
VS_1_3 = 0x00010300
FIRMWARE_REVISION = "0.1.0"
AER_OUTSTANDING_MAX = 4  # AERL + 1: AERs a host may leave outstanding (SPDK: 4)
NN_DEFAULT = 32  # SPDK's max_namespaces default, reported as NN
_CC_EN = 0x1
_CC_SHN_MASK = 0x3 << 14
_CSTS_RDY = 0x1
_CSTS_SHST_COMPLETE = 0x2 << 2
# Features whose value we store and report as set; the rest are refused with Invalid Field.
_STORED_FEATURES = frozenset(
    {
        FeatureId.ARBITRATION,
        FeatureId.POWER_MANAGEMENT,
        FeatureId.TEMPERATURE_THRESHOLD,
        FeatureId.ERROR_RECOVERY,
        FeatureId.VOLATILE_WRITE_CACHE,
        FeatureId.INTERRUPT_COALESCING,
        FeatureId.WRITE_ATOMICITY,
        FeatureId.ASYNC_EVENT_CONFIG,
    }
)


class Completion(NamedTuple):
    """What an admin command completes with; `data` goes to the host before the CQE."""

    status: Status = Status.SUCCESS
    cdw0: int = 0
    cdw1: int = 0  # Property Get of an 8-byte property: the high half
    data: bytes | None = None
    hold: bool = False  # an AER: no completion now


OK = Completion()


class Controller:
    """State of one controller: created by an admin-queue Connect, gone when that queue goes."""

    def __init__(
        self,
        *,
        cntlid: int,
        subsystem: Subsystem | None,
        subnqn: str,
        hostnqn: str,
        hostid: bytes,
        kato_ms: int,
        options: TargetOptions,
        discovery_log: Callable[[str], bytes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cntlid = cntlid
        self.subsystem = subsystem  # None: the discovery controller
        self.subnqn = subnqn
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.options = options
        self._discovery_log = discovery_log
        self._clock = clock
        self.kato_ms = self._round_kato(kato_ms)
        self.last_keep_alive_s = clock()
        self.cc = 0
        self.csts = 0
        self.io_queues_granted = options.max_io_qpairs_per_ctrlr
        self.io_queue_count = 0  # I/O queues ever connected (Number of Queues is fixed after)
        self.aer_cids: list[int] = []
        self.features: dict[int, int] = {f: 0 for f in _STORED_FEATURES}
        self.features[FeatureId.TEMPERATURE_THRESHOLD] = 0x0157  # 343 K, the spec's default
        self.closed = False
        self.buffers = BufferBudget()  # data buffers of all its queues together
        self.address = ""  # the admin queue's peer address (per-address caps)
        # False while the admin queue must still authenticate (DH-HMAC-CHAP): the target
        # counts such controllers apart and evicts them first (docs/NVME_AUTH.md, Budgets)
        self.authenticated = True

    @property
    def is_discovery(self) -> bool:
        return self.subsystem is None

    @property
    def enabled(self) -> bool:
        return bool(self.csts & _CSTS_RDY)

    def _round_kato(self, kato_ms: int) -> int:
        """SPDK rounds KATO up to a multiple of the KAS granularity (10 s by default, so also
        its minimum); kato 0 still times out after KATO_IDLE_MS without any command."""
        g = self.options.keep_alive_granularity_ms
        kato_ms = kato_ms or KATO_IDLE_MS
        return -(-kato_ms // g) * g

    def keep_alive(self) -> None:
        self.last_keep_alive_s = self._clock()

    def keep_alive_expired(self, now_s: float) -> bool:
        return bool(self.kato_ms) and (now_s - self.last_keep_alive_s) * 1000 > self.kato_ms

    # -- properties -----------------------------------------------------------------------

    @property
    def cap(self) -> int:
        mqes = self.options.max_queue_depth - 1
        timeout_500ms = 15  # CAP.TO: how long a host waits for CSTS.RDY (we are ready at once)
        css_nvm = 1 << 37
        return mqes | (1 << 16) | (timeout_500ms << 24) | css_nvm  # CQR = 1, MPSMIN = 4 KiB

    def property_get(self, sqe: Sqe) -> Completion:
        size8 = bool(sqe.cdw10 & 0x7)
        offset = sqe.cdw11
        values = {
            Property.CAP: self.cap,
            Property.VS: VS_1_3,
            Property.CC: self.cc,
            Property.CSTS: self.csts,
        }
        if offset not in values or size8 != (offset == Property.CAP):
            return Completion(Status.INVALID_FIELD)
        value = values[Property(offset)]
        return Completion(cdw0=value & 0xFFFFFFFF, cdw1=value >> 32)

    def property_set(self, sqe: Sqe) -> tuple[Completion, bool]:
        """Returns (completion, reset): reset asks the caller to drop the I/O queues."""
        if sqe.cdw11 != Property.CC or sqe.cdw10 & 0x7:
            return Completion(Status.INVALID_FIELD), False
        new, old = sqe.cdw12, self.cc
        self.cc = new
        reset = False
        if new & _CC_EN and not old & _CC_EN:
            self.csts |= _CSTS_RDY
        elif not new & _CC_EN and old & _CC_EN:
            self.csts &= ~_CSTS_RDY
            reset = True
        if new & _CC_SHN_MASK:
            self.csts |= _CSTS_SHST_COMPLETE
        return OK, reset

    # -- admin commands -------------------------------------------------------------------

    def admin(self, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
        """Execute one admin command other than the Fabrics ones the connection handles."""
        op = sqe.opcode
        if not self.enabled:
            return Completion(Status.COMMAND_SEQUENCE_ERROR)
        if op == AdminOpcode.IDENTIFY:
            return self._identify(sqe)
        if op == AdminOpcode.GET_LOG_PAGE:
            return self._get_log_page(sqe)
        if op == AdminOpcode.KEEP_ALIVE:
            self.keep_alive()
            return OK
        if op == AdminOpcode.SET_FEATURES:
            return self._set_features(sqe)
        if op == AdminOpcode.GET_FEATURES:
            return self._get_features(sqe)
        if op == AdminOpcode.ASYNC_EVENT_REQUEST:
            if len(self.aer_cids) >= AER_OUTSTANDING_MAX:
                return Completion(Status.ASYNC_EVENT_LIMIT_EXCEEDED)
            self.aer_cids.append(sqe.cid)
            return Completion(hold=True)
        if op == AdminOpcode.ABORT:
            return Completion(cdw0=1)  # bit 0 set: the command was not aborted
        return Completion(Status.INVALID_OPCODE)

    def identify_controller(self) -> IdentifyController:
        o = self.options
        sub = self.subsystem
        nn = max([NN_DEFAULT, *sub.namespaces]) if sub else 0
        return IdentifyController(
            sn=sub.serial if sub else "",
            mn=sub.model if sub else "dpu-kvtier discovery",
            fr=FIRMWARE_REVISION,
            cmic=0x02 if sub else 0,  # may have several controllers (SPDK sets it)
            mdts=o.mdts,
            cntlid=self.cntlid,
            ver=VS_1_3,
            ctratt=0x1,  # 128-bit host identifier
            cntrltype=CNTRLTYPE_IO if sub else CNTRLTYPE_DISCOVERY,
            aerl=AER_OUTSTANDING_MAX - 1,
            lpa=0x04,  # extended data for Get Log Page
            kas=o.keep_alive_granularity_ms // 100,
            maxcmd=o.max_queue_depth,
            nn=nn,
            oncs=0x0C if sub else 0,  # Dataset Management, Write Zeroes
            vwc=0x05 if sub else 0,  # volatile write cache present (Flush reaches fsync)
            sgls=0x100001,  # SGLs supported, offsets in SGL data blocks (in-capsule data)
            subnqn=self.subnqn,
            ioccsz=(64 + o.in_capsule_data_size) // 16,
            iorcsz=1,
            msdbd=1,
        )

    def _identify(self, sqe: Sqe) -> Completion:
        cns = sqe.cdw10 & 0xFF
        if cns == Cns.CONTROLLER:
            return Completion(data=self.identify_controller().pack())
        sub = self.subsystem
        if sub is None:
            return Completion(Status.INVALID_FIELD)
        if cns == Cns.ACTIVE_NAMESPACES:
            if sqe.nsid >= 0xFFFFFFFE:
                return Completion(Status.INVALID_NAMESPACE)
            ids = sorted(n for n in sub.namespaces if n > sqe.nsid)[:1024]
            return Completion(data=b"".join(n.to_bytes(4, "little") for n in ids))
        if cns in (Cns.NAMESPACE, Cns.NS_ID_DESCRIPTORS):
            dev = sub.namespaces.get(sqe.nsid)
            if dev is None:
                if cns == Cns.NAMESPACE and 0 < sqe.nsid <= max([NN_DEFAULT, *sub.namespaces]):
                    return Completion(data=bytes(IDENTIFY_BYTES))  # an inactive nsid: all zeros
                return Completion(Status.INVALID_NAMESPACE)
            nguid, uuid = namespace_ids(sub.nqn, sqe.nsid)
            if cns == Cns.NS_ID_DESCRIPTORS:
                return Completion(data=ns_id_descriptors(nguid=nguid, uuid=uuid))
            n = dev.block_count
            assert dev.block_size == BLOCK_SIZE, dev.block_size
            ns = IdentifyNamespace(nsze=n, ncap=n, nuse=n, nmic=1, nguid=nguid)
            return Completion(data=ns.pack())
        return Completion(Status.INVALID_FIELD)

    def _get_log_page(self, sqe: Sqe) -> Completion:
        lid = sqe.cdw10 & 0xFF
        numd = ((sqe.cdw11 & 0xFFFF) << 16 | sqe.cdw10 >> 16) + 1
        offset = sqe.cdw12 | sqe.cdw13 << 32
        length = numd * 4
        if offset % 4:
            return Completion(Status.INVALID_FIELD)
        if lid == LogPageId.DISCOVERY and self.is_discovery:
            page = self._discovery_log(self.hostnqn)
        elif lid in (LogPageId.ERROR, LogPageId.SMART, LogPageId.FIRMWARE_SLOT) or (
            lid == LogPageId.CHANGED_NAMESPACES and not self.is_discovery
        ):
            page = b""  # nothing to report: all zeros
        else:
            return Completion(Status.INVALID_LOG_PAGE)
        # the page's bytes, zero-padded to one 4 KiB structure at most: never to the host's
        # length (up to 16 GiB) nor its SGL's (a 4 MiB reply per command was the attack)
        chunk = page[offset : offset + length]
        return Completion(
            data=chunk + bytes(max(0, min(length, ADMIN_REPLY_BYTES_MAX) - len(chunk)))
        )

    def _set_features(self, sqe: Sqe) -> Completion:
        fid = sqe.cdw10 & 0xFF
        if sqe.cdw10 & (1 << 31):
            return Completion(Status.FEATURE_NOT_SAVEABLE)
        if fid == FeatureId.NUMBER_OF_QUEUES:
            if self.io_queue_count:  # SPDK: only before any I/O queue is connected
                return Completion(Status.COMMAND_SEQUENCE_ERROR)
            nsqr, ncqr = sqe.cdw11 & 0xFFFF, sqe.cdw11 >> 16
            if nsqr == 0xFFFF or ncqr == 0xFFFF:
                return Completion(Status.INVALID_FIELD)
            granted = min(max(nsqr, ncqr) + 1, self.options.max_io_qpairs_per_ctrlr)
            self.io_queues_granted = granted
            return Completion(cdw0=(granted - 1) | (granted - 1) << 16)
        if fid == FeatureId.KEEP_ALIVE_TIMER:
            self.kato_ms = self._round_kato(sqe.cdw11)
            self.keep_alive()
            return OK
        if fid in _STORED_FEATURES:
            self.features[fid] = sqe.cdw11
            return OK
        return Completion(Status.INVALID_FIELD)

    def _get_features(self, sqe: Sqe) -> Completion:
        fid = sqe.cdw10 & 0xFF
        if fid == FeatureId.NUMBER_OF_QUEUES:
            n = self.io_queues_granted - 1
            return Completion(cdw0=n | n << 16)
        if fid == FeatureId.KEEP_ALIVE_TIMER:
            return Completion(cdw0=self.kato_ms)
        if fid in self.features:
            return Completion(cdw0=self.features[fid])
        return Completion(Status.INVALID_FIELD)

    def fabrics_property(self, sqe: Sqe) -> tuple[Completion, bool]:
        """Property Get/Set; returns (completion, reset)."""
        if sqe.fctype == FabricsType.PROPERTY_GET:
            return self.property_get(sqe), False
        return self.property_set(sqe)
