"""NvmeTcpTarget: the embedded-mode NVMe/TCP target (asyncio), serving Subsystems.

Control plane here (Connect, controllers, keep-alive, discovery, subsystems coming and going),
logged in full; the data path lives in `_connection.py` and never logs per PDU.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ipaddress
import resource
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dpu_agent.log import RateLimitedLog, get_logger, nqn_tag
from dpu_agent.nvmf._auth import needs_auth
from dpu_agent.nvmf._connection import NvmfConnection
from dpu_agent.nvmf._controller import CNTLID_MAX, CNTLID_MIN, Controller
from dpu_agent.nvmf._host_keys import nqn_hash
from dpu_agent.nvmf._limits import (
    CONTROLLERS_PER_ADDRESS_MAX,
    CONTROLLERS_PER_HOST_MAX,
    CONTROLLERS_PER_TENANT_MAX,
    DISCOVERY_CONTROLLERS_MAX,
    HOST_BUFFER_BYTES_MAX,
    QUEUES_PER_HOST_MAX,
    QUEUES_PER_TENANT_MAX,
    TARGET_BUFFER_BYTES_MAX,
    TENANT_BUFFER_BYTES_MAX,
    UNAUTHENTICATED_CONTROLLERS_MAX,
    UNAUTHENTICATED_CONTROLLERS_PER_ADDRESS_MAX,
    UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX,
    UNAUTHENTICATED_CONTROLLERS_PER_TENANT_MAX,
    UNCONNECTED_MAX,
    UNCONNECTED_PER_ADDRESS_MAX,
    BufferBudget,
)
from dpu_agent.nvmf._subsystem import DISCOVERY_NQN, Subsystem, TargetOptions, check_namespace
from dpu_agent.nvmf._tls import TlsServerProtocol, check_secure, psk_lookup
from dpu_agent.ratelimit import TokenBuckets
from dpu_agent.runclock import run_clock
from kvproto.nvme import CONNECT_DATA_BYTES, ConnectData, ConnectDataError, Status
from kvproto.nvme._structs import ADRFAM_IPV4, ADRFAM_IPV6, DiscoveryEntry, DiscoveryLog

if TYPE_CHECKING:
    from dpu_agent.nvmf._connection import _Cmd

__all__ = ["CONNECTIONS_MAX", "NvmeTcpTarget"]

log = get_logger("dpu_agent.nvmf")
refusals = RateLimitedLog(log)  # refused peers: a flood costs a few lines a second

# Connections served at once; more are closed at accept. 1024 hosts x a few queues is beyond
# what one DPU agent serves; the bound keeps a connection flood from exhausting descriptors.
CONNECTIONS_MAX = 4096
# Offsets for the Connect error's IPO (SPDK_NVMF_INVALID_CONNECT_DATA / _CMD).
_IPO_CNTLID, _IPO_SUBNQN, _IPO_HOSTNQN = 16, 256, 512
_IPO_QID, _IPO_SQSIZE = 42, 44


# Threads that decrypt reads of memory-only devices (the DRAM tier). One: a decryption is
# ~50 us per MiB, so one thread outruns the socket many times over, and it decrypts in the
# order the commands came, which is the order the loop sends them. Four threads decrypting
# at once on the 2-vCPU box preempted the loop's send and the host: at 1 MiB QD8, 4.3 GB/s
# with the four-thread pool vs 4.5-4.7 with one (A/B runs under the bench lock).
MEMORY_LANE_WORKERS = 1
# Reads of the NVMe tier's mapped file share the lane (a cipher pass out of the page cache, as
# for DRAM: 1 MiB QD8 moved 0.74-0.87 of the socket ceiling there against 0.61-0.73 through
# preadv in the pool, docs/BENCHMARKS.md). A read whose pages are not cached waits on the disk
# and would hold up every read queued behind it: a lane call that took a major page fault (the
# thread's ru_majflt: it waited for the disk) sends the lane's work to the pool, whose threads
# wait on the disk side by side, for LANE_BACKOFF_S. Not wall time: a call also waits for the
# GIL after its cipher pass (up to the 5 ms switch interval), which is no reason to leave.
LANE_BACKOFF_S = 1.0


# DH-HMAC-CHAP's finite-field DH steps (a Challenge's key, a Reply's shared secret: ~6 ms each
# for ffdhe8192 here, GIL released) run on this many threads, off the event loop: one, so
# strangers' authentications can take one core's share at most, never the loop's.
AUTH_WORKERS = 1
# DH steps queued for those threads at once; beyond, the step is refused (AUTH_Failure1): 32 x
# ~6 ms is a 0.2 s wait for the last legitimate host in a reconnect storm, bounded.
AUTH_PENDING_MAX = 32
# DH steps per source address: a burst of this many (one server's clients reconnecting, two
# steps per queue: 16 clients x admin + 3 I/O queues x 2 is 128), then this many a second (a
# steady 16/s is ~10 % of one core at ffdhe8192). Beyond, refused (AUTH_Failure1).
AUTH_DH_BURST_PER_ADDRESS_MAX = 128
AUTH_DH_PER_ADDRESS_PER_S = 16.0
# Addresses whose DH budget is remembered; beyond, the least recently used is forgotten (it
# starts again with a full burst, still bounded by AUTH_PENDING_MAX).
AUTH_RATE_ADDRESSES_MAX = 4096
# TLS handshakes in progress (secure channel): counted from the first byte, before any TLS
# state exists. Per address as UNCONNECTED_PER_ADDRESS_MAX (a host's queues connect at once),
# in all as UNCONNECTED_MAX; at a cap the oldest handshake of the fullest address goes.
HANDSHAKES_PER_ADDRESS_MAX = UNCONNECTED_PER_ADDRESS_MAX
HANDSHAKES_MAX = UNCONNECTED_MAX


def _victim(items: Iterable[tuple[Any, str]]) -> Any | None:
    """Of (item, address) pairs in age order (oldest first): the oldest item of the address
    that has the most. A flood from one address evicts its own, not another host's."""
    by_address: dict[str, list[Any]] = {}
    for item, address in items:
        by_address.setdefault(address, []).append(item)
    if not by_address:
        return None
    return max(by_address.values(), key=len)[0]


def _major_faults() -> int:
    """Page faults of the calling thread that waited for the disk (0.4 us a call)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


class NvmeTcpTarget:
    """Serve `subsystems` over NVMe/TCP on host:port (port 0: pick one, see `.port`)."""

    def __init__(
        self,
        subsystems: Iterable[Subsystem] = (),
        host: str = "127.0.0.1",
        port: int = 4420,
        *,
        options: TargetOptions | None = None,
        clock: Callable[[], float] = run_clock,  # a pause of ours is no host's silence
        secure_channel: bool = False,
    ) -> None:
        """`secure_channel`: the listener speaks TLS 1.3 with PSKs only (docs/NVME_AUTH.md)."""
        self.secure_channel = secure_channel
        self.host = host
        self.port = port
        self.options = options or TargetOptions()
        self._clock = clock
        self._subsystems: dict[str, Subsystem] = {}
        for sub in subsystems:
            self._add(sub)
        self._controllers: dict[int, Controller] = {}
        self._ctrl_conns: dict[int, set[NvmfConnection]] = {}
        self._connections: set[NvmfConnection] = set()
        self._unconnected: dict[NvmfConnection, str] = {}  # before Connect: conn -> address
        self._next_cntlid = CNTLID_MIN
        self._genctr = 0
        self._server: asyncio.Server | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._memory_lane: concurrent.futures.ThreadPoolExecutor | None = None
        self._lane_slow_until = 0.0  # monotonic: a lane call waited for the disk
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ka_task: asyncio.Task[None] | None = None
        # controllers whose admin queue has not authenticated yet, oldest first
        self._unauthenticated: dict[Controller, None] = {}
        # controllers (not discovery) per ("host", subnqn, hostnqn) / ("tenant", subnqn) /
        # ("address", address), for the caps in _make_room
        self._ctrl_counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        # data buffers: the target's budget, and one per tenant and per (tenant, host)
        self.buffers = BufferBudget(TARGET_BUFFER_BYTES_MAX)
        self._tenant_buffers: dict[str, BufferBudget] = {}
        self._host_buffers: dict[tuple[str, str], BufferBudget] = {}
        self._auth_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._auth_pending = 0
        self._auth_rate = TokenBuckets(
            AUTH_DH_BURST_PER_ADDRESS_MAX, AUTH_DH_PER_ADDRESS_PER_S, AUTH_RATE_ADDRESSES_MAX
        )
        self._handshakes: dict[Any, str] = {}  # TLS handshakes in progress -> address

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        assert self._server is None, "target already started"
        self._loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.options.io_workers, thread_name_prefix="nvmf-io"
        )
        self._memory_lane = concurrent.futures.ThreadPoolExecutor(
            max_workers=MEMORY_LANE_WORKERS, thread_name_prefix="nvmf-mem"
        )
        self._auth_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=AUTH_WORKERS, thread_name_prefix="nvmf-auth"
        )
        self._server = await self._loop.create_server(
            self._protocol_factory(), self.host, self.port, reuse_address=True, backlog=128
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ka_task = asyncio.create_task(self._keep_alive_loop(), name="nvmf-keep-alive")
        log.info(
            "nvmf_target_started",
            host=self.host,
            port=self.port,
            subsystems=sorted(self._subsystems),
            max_io_size=self.options.max_io_size,
        )

    def _protocol_factory(self) -> Callable[[], asyncio.BaseProtocol]:
        if not self.secure_channel:
            return lambda: NvmfConnection(self)
        lookup = psk_lookup(lambda: self._subsystems)
        return lambda: TlsServerProtocol(self, lookup)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        if self._ka_task is not None:
            self._ka_task.cancel()
        for conn in list(self._connections):
            conn.close()
        await self._server.wait_closed()
        await asyncio.sleep(0)  # let connection_lost callbacks run
        assert self._executor is not None
        executor, self._executor = self._executor, None
        await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
        if self._memory_lane is not None:
            lane, self._memory_lane = self._memory_lane, None
            await asyncio.get_running_loop().run_in_executor(None, lane.shutdown, True)
        if self._auth_executor is not None:
            auth, self._auth_executor = self._auth_executor, None
            await asyncio.get_running_loop().run_in_executor(None, auth.shutdown, True)
        self._server = None
        log.info("nvmf_target_stopped", host=self.host, port=self.port)

    async def __aenter__(self) -> NvmeTcpTarget:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- subsystems -----------------------------------------------------------------------

    @property
    def subsystems(self) -> dict[str, Subsystem]:
        return dict(self._subsystems)

    def _add(self, sub: Subsystem) -> None:
        if sub.nqn in self._subsystems:
            raise ValueError(f"subsystem {sub.nqn} already exported; remove it first")
        for nsid, dev in sub.namespaces.items():
            check_namespace(nsid, dev)
        self._subsystems[sub.nqn] = sub

    def add_subsystem(self, sub: Subsystem) -> None:
        """Export `sub` (allowed while running; hosts find it in the discovery log)."""
        self._add(sub)
        self._genctr += 1
        log.info("nvmf_subsystem_added", nqn=sub.nqn, namespaces=sorted(sub.namespaces))

    def remove_subsystem(self, nqn: str) -> Subsystem:
        """Stop exporting `nqn` and disconnect its controllers."""
        sub = self._subsystems.pop(nqn)
        self._genctr += 1
        for ctrl in [c for c in self._controllers.values() if c.subsystem is sub]:
            self.destroy_controller(ctrl, reason="subsystem removed")
        log.info("nvmf_subsystem_removed", nqn=nqn)
        return sub

    def discovery_log(self, hostnqn: str) -> bytes:
        adrfam = ADRFAM_IPV6 if ipaddress.ip_address(self.host).version == 6 else ADRFAM_IPV4
        entries = tuple(
            DiscoveryEntry(
                subnqn=s.nqn,
                traddr=self.host,
                trsvcid=str(self.port),
                adrfam=adrfam,
                asqsz=self.options.max_aq_depth,
            )
            for s in sorted(self._subsystems.values(), key=lambda s: s.nqn)
            if s.host_allowed(hostnqn)
        )
        return DiscoveryLog(genctr=self._genctr, entries=entries).pack()

    # -- device I/O -----------------------------------------------------------------------

    def run_io(self, fn: Callable[..., None], *args: Any) -> asyncio.Future[None]:
        assert self._loop is not None and self._executor is not None
        return self._loop.run_in_executor(self._executor, fn, *args)

    def submit_io(
        self,
        done: Callable[[Exception | None], None],
        fn: Callable[..., None],
        *args: Any,
        memory: bool = False,
    ) -> None:
        """Run `fn(*args)` in the I/O pool, then `done(its exception or None)` on the loop:
        one loop wake-up per command, where run_in_executor's chain of futures takes a
        wake-up and another loop turn (per-command work that shows at 1 MiB QD8).

        `memory`: memory-only work (decrypting a read of the DRAM tier or of the NVMe tier's
        page cache) goes to the memory lane instead, one thread that runs it in arrival order
        (MEMORY_LANE_WORKERS), unless a lane call waited for the disk lately (LANE_BACKOFF_S)."""
        loop = self._loop
        lane = memory and time.monotonic() >= self._lane_slow_until
        executor = self._memory_lane if lane else self._executor
        assert loop is not None and executor is not None

        def work() -> None:
            exc: Exception | None = None
            faults = _major_faults() if lane else 0
            try:
                fn(*args)
            except Exception as e:
                exc = e
            if lane and _major_faults() > faults:
                self._lane_slow_until = time.monotonic() + LANE_BACKOFF_S
            try:
                loop.call_soon_threadsafe(done, exc)
            except RuntimeError:  # the loop has closed: nobody waits for this command
                pass

        executor.submit(work)

    # -- authentication work --------------------------------------------------------------

    def auth_work_allowed(self, address: str) -> bool:
        """Whether a DH step for a queue from `address` may run now: its address has budget
        left (AUTH_DH_PER_ADDRESS_PER_S) and the auth executor's queue has room."""
        if self._auth_pending >= AUTH_PENDING_MAX:
            return False
        return self._auth_rate.take(address, time.monotonic())

    def auth_work(
        self,
        work: Callable[[], bytes | None],
        done: Callable[[bytes | None, BaseException | None], None],
    ) -> None:
        """Run `work` on the auth executor, then `done(result, exception)` on the loop."""
        loop, executor = self._loop, self._auth_executor
        assert loop is not None and executor is not None
        self._auth_pending += 1

        def run() -> None:
            result, exc = None, None
            try:
                result = work()
            except Exception as e:
                exc = e

            def finish() -> None:
                self._auth_pending -= 1
                done(result, exc)

            try:
                loop.call_soon_threadsafe(finish)
            except RuntimeError:  # the loop has closed: nobody waits for it
                pass

        executor.submit(run)

    # -- TLS handshakes (secure channel) ---------------------------------------------------

    def handshake_started(self, proto: Any, address: str) -> bool:
        """A TLS connection sent its first byte: count it. At HANDSHAKES_PER_ADDRESS_MAX or
        HANDSHAKES_MAX the oldest handshake of the fullest address is closed to make room;
        False: refused (more connections than CONNECTIONS_MAX)."""
        if len(self._connections) + len(self._handshakes) >= CONNECTIONS_MAX:
            return False
        for same_address, cap in ((True, HANDSHAKES_PER_ADDRESS_MAX), (False, HANDSHAKES_MAX)):
            while True:
                scope = [(p, a) for p, a in self._handshakes.items()
                         if not same_address or a == address]  # fmt: skip
                if len(scope) < cap:
                    break
                victim = _victim(scope)
                assert victim is not None, scope  # the scope is full, so not empty
                self._handshakes.pop(victim, None)
                refusals.warning("nvmf_tls_handshake_evicted", peer=address,
                                 reason="HANDSHAKES_PER_ADDRESS_MAX" if same_address
                                 else "HANDSHAKES_MAX")  # fmt: skip
                victim.abort_handshake()
        self._handshakes[proto] = address
        return True

    def handshake_ended(self, proto: Any) -> None:
        self._handshakes.pop(proto, None)

    # -- connections and controllers ------------------------------------------------------

    def connection_opened(self, conn: NvmfConnection) -> None:
        address = conn.peer.rpartition(":")[0]
        if len(self._connections) >= CONNECTIONS_MAX:
            refusals.warning("nvmf_connection_refused", peer=conn.peer, reason="CONNECTIONS_MAX")
            conn.close()
            return
        # At a cap on connections that have not sent Connect yet, the oldest of this address
        # (or, target-wide, the oldest) goes, not the newcomer: a stranger's idle sockets must
        # not lock out a host behind the same address.
        same = [c for c, a in self._unconnected.items() if a == address]
        if len(same) >= UNCONNECTED_PER_ADDRESS_MAX:
            self._drop_unconnected(same[0], "UNCONNECTED_PER_ADDRESS_MAX")
        elif len(self._unconnected) >= UNCONNECTED_MAX:
            self._drop_unconnected(next(iter(self._unconnected)), "UNCONNECTED_MAX")
        self._connections.add(conn)
        self._unconnected[conn] = address

    def _drop_unconnected(self, conn: NvmfConnection, reason: str) -> None:
        self._unconnected.pop(conn, None)
        refusals.warning("nvmf_connection_evicted", peer=conn.peer, reason=reason)
        conn.close()

    def connection_connected(self, conn: NvmfConnection) -> None:
        """Connect succeeded: the connection counts as a known host's from now on."""
        self._unconnected.pop(conn, None)

    def connection_closed(self, conn: NvmfConnection) -> None:
        self._connections.discard(conn)
        self._unconnected.pop(conn, None)
        ctrl = conn.ctrl
        if ctrl is None:
            return
        conns = self._ctrl_conns.get(ctrl.cntlid)
        if conns is not None:
            conns.discard(conn)
        if conn.qid == 0:
            self.destroy_controller(ctrl, reason="admin queue closed")

    def destroy_controller(self, ctrl: Controller, *, reason: str) -> None:
        if ctrl.closed:
            return
        ctrl.closed = True
        if self._controllers.pop(ctrl.cntlid, None) is ctrl:
            self._count(ctrl, -1)
        self._unauthenticated.pop(ctrl, None)
        conns = self._ctrl_conns.pop(ctrl.cntlid, set())
        for conn in conns:
            conn.close()
        log.info(
            "nvmf_controller_destroyed",
            cntlid=ctrl.cntlid,
            subnqn=ctrl.subnqn,
            host=nqn_tag(ctrl.hostnqn),
            reason=reason,
        )

    def disconnect_host(self, subnqn: str, hostnqn: str) -> int:
        """Destroy the controllers `hostnqn` has on `subnqn` (its allowlist entry went)."""
        gone = [c for c in self._controllers.values()
                if c.subnqn == subnqn and c.hostnqn == hostnqn]  # fmt: skip
        for ctrl in gone:
            self.destroy_controller(ctrl, reason="host no longer allowed")
        return len(gone)

    def reset_io_queues(self, ctrl: Controller) -> None:
        """CC.EN 1 -> 0: the controller resets and its I/O queues go."""
        for conn in list(self._ctrl_conns.get(ctrl.cntlid, ())):
            if conn.qid:
                conn.close()
        ctrl.io_queue_count = 0

    async def _keep_alive_loop(self) -> None:
        period_s = min(1.0, max(0.05, self.options.keep_alive_granularity_ms / 4000))
        while True:
            await asyncio.sleep(period_s)
            now = self._clock()
            for ctrl in list(self._controllers.values()):
                if ctrl.keep_alive_expired(now):
                    self.destroy_controller(ctrl, reason=f"keep-alive timeout {ctrl.kato_ms} ms")
            r2t_now = run_clock()
            for conn in list(self._connections):
                conn.expire_r2t(r2t_now)
            self._forget_idle_budgets()

    def _queues_full(self, ctrl: Controller) -> str:
        """'' if one more queue fits QUEUES_PER_HOST_MAX and QUEUES_PER_TENANT_MAX."""
        host = tenant = 0
        for c in self._controllers.values():
            if c.subnqn == ctrl.subnqn:
                n = len(self._ctrl_conns.get(c.cntlid, ()))
                tenant += n
                host += n if c.hostnqn == ctrl.hostnqn else 0
        if host >= QUEUES_PER_HOST_MAX:
            return "QUEUES_PER_HOST_MAX"
        return "QUEUES_PER_TENANT_MAX" if tenant >= QUEUES_PER_TENANT_MAX else ""

    def _new_cntlid(self) -> int | None:
        span = CNTLID_MAX - CNTLID_MIN + 1
        for _ in range(span):
            cntlid = self._next_cntlid
            self._next_cntlid = CNTLID_MIN + (cntlid - CNTLID_MIN + 1) % span
            if cntlid not in self._controllers:
                return cntlid
        return None

    def connect(
        self, conn: NvmfConnection, cmd: _Cmd, data: bytes | bytearray | memoryview
    ) -> None:
        """Fabrics Connect, with SPDK's status codes for each refusal."""
        sqe = cmd.sqe
        if conn.qid is not None:
            return conn.connect_refused(cmd, Status.COMMAND_SEQUENCE_ERROR)
        if sqe.cdw10 & 0xFFFF:
            return conn.connect_refused(cmd, Status.CONNECT_INCOMPATIBLE_FORMAT)
        if len(data) < CONNECT_DATA_BYTES:
            return conn.connect_refused(cmd, Status.DATA_SGL_LENGTH_INVALID)
        try:
            cd = ConnectData.unpack(data)
        except ConnectDataError as e:
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, e.offset)
        except ValueError:
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, 0)
        qid, sqsize = sqe.cdw10 >> 16, sqe.cdw11 & 0xFFFF
        sub = self._subsystems.get(cd.subnqn)
        if sub is None and cd.subnqn != DISCOVERY_NQN:
            refusals.warning(
                "nvmf_connect_refused", peer=conn.peer, subnqn=cd.subnqn[:64],
                reason="unknown subsystem",
            )  # fmt: skip
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, _IPO_SUBNQN)
        if sub is not None and not sub.host_allowed(cd.hostnqn, conn.peer.rpartition(":")[0]):
            refusals.warning(
                "nvmf_connect_refused",
                peer=conn.peer,
                subnqn=cd.subnqn,
                host=nqn_tag(cd.hostnqn),
                reason="host not allowed (from this address)",
            )
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_HOST)
        if not check_secure(conn, sub, cd.subnqn, cd.hostnqn):
            log.warning(
                "nvmf_connect_refused",
                peer=conn.peer,
                host=nqn_hash(cd.hostnqn),
                subnqn=cd.subnqn,
                reason="not the TLS identity or no secure channel",
            )
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_HOST)
        depth_max = self.options.max_aq_depth if qid == 0 else self.options.max_queue_depth
        if sqsize == 0 or sqsize >= depth_max:
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 0, _IPO_SQSIZE)
        if qid == 0:
            return self._connect_admin(conn, cmd, cd, sub)
        return self._connect_io(conn, cmd, cd, qid)

    def _connect_admin(
        self, conn: NvmfConnection, cmd: _Cmd, cd: ConnectData, sub: Subsystem | None
    ) -> None:
        if cd.cntlid != 0xFFFF:  # only the dynamic controller model
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, _IPO_CNTLID)
        address = conn.peer.rpartition(":")[0]
        discovery = sum(c.is_discovery for c in self._controllers.values())
        if sub is None and discovery >= DISCOVERY_CONTROLLERS_MAX:
            return conn.connect_refused(cmd, Status.CONNECT_CONTROLLER_BUSY)
        authenticate = sub is not None and needs_auth(sub, cd.hostnqn)
        if sub is not None:
            busy = self._make_room(sub.nqn, cd.hostnqn, address, authenticate)
            if busy:
                refusals.warning("nvmf_connect_refused", peer=conn.peer, subnqn=cd.subnqn,
                                 host=nqn_tag(cd.hostnqn), reason=busy)  # fmt: skip
                return conn.connect_refused(cmd, Status.CONNECT_CONTROLLER_BUSY)
        cntlid = self._new_cntlid()
        if cntlid is None:
            return conn.connect_refused(cmd, Status.CONNECT_CONTROLLER_BUSY)
        ctrl = Controller(
            cntlid=cntlid,
            subsystem=sub,
            subnqn=cd.subnqn,
            hostnqn=cd.hostnqn,
            hostid=cd.hostid,
            kato_ms=cmd.sqe.cdw12,
            options=self.options,
            discovery_log=self.discovery_log,
            clock=self._clock,
        )
        ctrl.address = address
        ctrl.buffers.parent = self._buffer_parent(sub, cd.hostnqn)
        if authenticate:
            ctrl.authenticated = False
            self._unauthenticated[ctrl] = None
        self._controllers[cntlid] = ctrl
        self._count(ctrl, 1)
        self._ctrl_conns[cntlid] = {conn}
        log.info(
            "nvmf_controller_created",
            cntlid=cntlid,
            subnqn=cd.subnqn,
            host=nqn_tag(cd.hostnqn),
            peer=conn.peer,
            kato_ms=ctrl.kato_ms,
        )
        conn.connect_done(cmd, ctrl, 0)

    def _make_room(self, subnqn: str, hostnqn: str, address: str, authenticate: bool) -> str:
        """Room for a new controller of `hostnqn` from `address` on `subnqn`: at a cap,
        unauthenticated controllers of that scope go first (the oldest of the address holding
        the most); '' when there is room, else the name of the cap that refuses it."""
        counts = self._ctrl_counts
        caps: list[tuple[str, int, Callable[[], int], Callable[[Controller], bool]]] = [
            ("CONTROLLERS_PER_HOST_MAX", CONTROLLERS_PER_HOST_MAX,
             lambda: counts[("host", subnqn, hostnqn)],
             lambda c: c.subnqn == subnqn and c.hostnqn == hostnqn),
            ("CONTROLLERS_PER_TENANT_MAX", CONTROLLERS_PER_TENANT_MAX,
             lambda: counts[("tenant", subnqn)], lambda c: c.subnqn == subnqn),
            ("CONTROLLERS_PER_ADDRESS_MAX", CONTROLLERS_PER_ADDRESS_MAX,
             lambda: counts[("address", address)], lambda c: c.address == address),
        ]  # fmt: skip
        if authenticate:
            unauth = self._unauthenticated

            def count(match: Callable[[Controller], bool]) -> Callable[[], int]:
                return lambda: sum(1 for c in unauth if match(c))

            scopes: list[tuple[str, int, Callable[[Controller], bool]]] = [
                ("UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX",
                 UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX,
                 lambda c: c.subnqn == subnqn and c.hostnqn == hostnqn),
                ("UNAUTHENTICATED_CONTROLLERS_PER_ADDRESS_MAX",
                 UNAUTHENTICATED_CONTROLLERS_PER_ADDRESS_MAX, lambda c: c.address == address),
                ("UNAUTHENTICATED_CONTROLLERS_PER_TENANT_MAX",
                 UNAUTHENTICATED_CONTROLLERS_PER_TENANT_MAX, lambda c: c.subnqn == subnqn),
                ("UNAUTHENTICATED_CONTROLLERS_MAX", UNAUTHENTICATED_CONTROLLERS_MAX,
                 lambda c: True),
            ]  # fmt: skip
            caps += [(name, cap, count(match), match) for name, cap, match in scopes]
        for name, cap, held, match in caps:
            while held() >= cap:
                victim = _victim((c, c.address) for c in self._unauthenticated if match(c))
                if victim is None:
                    return name
                self.destroy_controller(victim, reason=f"unauthenticated, {name}")
        return ""

    def _count(self, ctrl: Controller, delta: int) -> None:
        if ctrl.is_discovery:
            return
        for key in (
            ("host", ctrl.subnqn, ctrl.hostnqn),
            ("tenant", ctrl.subnqn),
            ("address", ctrl.address),
        ):
            self._ctrl_counts[key] += delta
            if not self._ctrl_counts[key]:
                del self._ctrl_counts[key]

    def _buffer_parent(self, sub: Subsystem | None, hostnqn: str) -> BufferBudget:
        """The budget a new controller's buffers are charged to beyond its own: its host's
        (within its tenant's, within the target's); the target's for a discovery one."""
        if sub is None:
            return self.buffers
        tenant = self._tenant_buffers.get(sub.nqn)
        if tenant is None:
            tenant = self._tenant_buffers[sub.nqn] = BufferBudget(
                TENANT_BUFFER_BYTES_MAX, self.buffers
            )
        host = self._host_buffers.get((sub.nqn, hostnqn))
        if host is None:
            host = self._host_buffers[sub.nqn, hostnqn] = BufferBudget(
                HOST_BUFFER_BYTES_MAX, tenant
            )
        return host

    def _forget_idle_budgets(self) -> None:
        """Drop host and tenant budgets with nothing charged and no controller left."""
        live = {(c.subnqn, c.hostnqn) for c in self._controllers.values()}
        for key, b in list(self._host_buffers.items()):
            if b.used == 0 and not b.pools and key not in live:
                del self._host_buffers[key]
        tenants = {k[0] for k in self._host_buffers}
        for nqn, b in list(self._tenant_buffers.items()):
            if b.used == 0 and not b.pools and nqn not in tenants:
                del self._tenant_buffers[nqn]

    def controller_authenticated(self, ctrl: Controller) -> None:
        """Its admin queue proved the host's key: it counts as the host's from now on."""
        ctrl.authenticated = True
        self._unauthenticated.pop(ctrl, None)

    def _connect_io(self, conn: NvmfConnection, cmd: _Cmd, cd: ConnectData, qid: int) -> None:
        ctrl = self._controllers.get(cd.cntlid)
        if ctrl is None or ctrl.subnqn != cd.subnqn or ctrl.hostnqn != cd.hostnqn:
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, _IPO_CNTLID)
        if conn.peer.rpartition(":")[0] != ctrl.address:
            # A controller's queues come from its host: cntlids are sequential and NQNs no
            # secret, so without this a stranger could hold another host's queues
            refusals.warning(
                "nvmf_connect_refused", peer=conn.peer, subnqn=cd.subnqn,
                host=nqn_tag(cd.hostnqn), reason="not its admin queue's address",
            )  # fmt: skip
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 1, _IPO_CNTLID)
        if ctrl.is_discovery or not ctrl.enabled or not self._qid_free(ctrl, qid):
            return conn.connect_refused(cmd, Status.CONNECT_INVALID_PARAMETERS, 0, _IPO_QID)
        busy = self._queues_full(ctrl)
        if busy:
            refusals.warning("nvmf_connect_refused", peer=conn.peer, subnqn=cd.subnqn,
                             host=nqn_tag(cd.hostnqn), reason=busy)  # fmt: skip
            return conn.connect_refused(cmd, Status.CONNECT_CONTROLLER_BUSY)
        self._ctrl_conns[ctrl.cntlid].add(conn)
        log.info("nvmf_io_queue_connected", cntlid=ctrl.cntlid, qid=qid, peer=conn.peer)
        conn.connect_done(cmd, ctrl, qid)
        if conn.auth is None:  # else it counts once it has proved the key (_auth.py)
            self.io_queue_proven(conn)

    def _qid_free(self, ctrl: Controller, qid: int) -> bool:
        """Whether `qid` is granted and no proven queue (`io_queue_proven`) holds it: one
        still authenticating holds nothing, so a queue without the key blocks no qid."""
        held = {c.qid for c in self._ctrl_conns.get(ctrl.cntlid, ()) if c.proven}
        return qid <= ctrl.io_queues_granted and qid not in held

    def io_queue_proven(self, conn: NvmfConnection) -> None:
        """An I/O queue that needs no key connected, or one that does proved it: it holds its
        qid and counts (Set Features, Number of Queues is refused from then on, as SPDK does).
        A queue whose qid another proved first (or no longer granted) is closed."""
        ctrl = conn.ctrl
        if ctrl is None or conn.proven or not conn.qid:
            return
        if not self._qid_free(ctrl, conn.qid):
            refusals.warning("nvmf_io_queue_refused", peer=conn.peer, qid=conn.qid,
                             reason="qid taken or not granted")  # fmt: skip
            return conn.close()
        conn.proven = True
        ctrl.io_queue_count += 1
