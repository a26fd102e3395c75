"""The agent's side of the NIXL data path: it drives every transfer (DESIGN.md, Data path).

What is registered with NIXL here: the staging buffers every chunk is decrypted into (get) or
read into before it is encrypted (put). Both tiers hold AES-XTS ciphertext (engine.tiers wraps
the DRAM tier too), so registering the tiers' own memory would hand hosts ciphertext; the
staging pool is the DRAM the NIC reads from and writes to, allocated and registered once.

get: lease the cached prefix, then per chunk and segment: decrypt into a free staging slot and
hash it into the chunk's xxh3-128 in the same pass (a worker thread, `CryptoBlockDevice.
read_hashed_into`), post a one-sided WRITE into the host's buffer; slots are reused as their
WRITEs complete, so decryption and the wire overlap. A chunk's segments feed its hash in order
(each waits for the one before it), so the workers take segments of different chunks in turn.
A chunk counts as loaded only when its checksum matched (the agent verifies, the host does no
per-byte work); the first mismatch ends the prefix and the chunk is deleted as corrupt.

put: per chunk: reserve, READ the host's buffer segment by segment into staging, hash, encrypt
and write to the tier (a worker thread), commit with the agent-computed checksum. The checksum
guards the stored bytes from here on; the bytes on the wire are guarded by the transport (RDMA
ICRC, TCP checksums), as on the NVMe/TCP path without digests.

Tenant isolation: a session's host NIXL agent must be named ``dpukv.<tenant>.*`` (checked in the
metadata before NIXL loads it), one session per name; a get or put may only target spans inside
regions its own session registered. NIXL itself also refuses addresses its remote metadata does
not cover (NIXL_ERR_NOT_FOUND): a second line, not the one relied on.

NIXL itself runs in a worker process (dpu_agent.nixl._worker) that maps the staging memory;
NIXL_LANES calls are served at once, each on its own thread with its own staging slots, and
their transfers go to the worker as commands (docs/TRANSPORT.md).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures as cf
import ctypes
import functools
import ipaddress
import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import xxhash

from dpu_agent.blockdev import BLOCK_SIZE
from dpu_agent.crypto.blockdev import CryptoBlockDevice
from dpu_agent.crypto.xts import Xxh3
from dpu_agent.engine import errors as engine_errors
from dpu_agent.log import get_logger
from dpu_agent.nixl._metadata import NixlMetadata, parse_metadata
from dpu_agent.runclock import run_clock
from host_shim.transport import NixlUnavailable, load_nixl, nixl_status
from kvproto.control import NIXL_REGIONS_MAX, RemoteProtocolError

__all__ = [
    "NIXL_IO_WORKERS",
    "NIXL_LANES",
    "NIXL_SEGMENT_BYTES",
    "NIXL_STAGING_SLOTS",
    "NixlServer",
    "metadata_agent_name",
]

log = get_logger("dpu_agent.nixl")

# One WRITE/READ moves a segment: 4 MiB is where UCX-TCP and one AES-XTS call run at full speed
# here (docs/MEASURED.md), and it bounds staging per slot.
NIXL_SEGMENT_BYTES = 4 << 20
# Segments in flight per lane: 8 x 4 MiB; enough to keep decryption and the wire both busy
# (more only adds memory).
NIXL_STAGING_SLOTS = 8
# Calls served at once (threads, each with its own staging slots): a session whose host stopped
# reading holds one lane until its deadline, the others keep serving. 4 x 32 MiB of staging.
NIXL_LANES = 4
# Lanes one tenant may hold at once: its frozen or slow sessions can take at most half of them,
# so another tenant always finds a lane.
NIXL_LANES_PER_TENANT = NIXL_LANES // 2
# The first segment of each of a get's first chunks (one per I/O thread): the first WRITE leaves
# after decrypting this much rather than a whole segment (0.7-2 ms of a 60 ms get here).
NIXL_FIRST_SEGMENT_BYTES = 1 << 20
NIXL_IO_WORKERS = 2  # decrypt/encrypt threads (AES-XTS releases the GIL); the DPU's spare cores
# One transfer (a 4 MiB segment, ~40 ms at 1 Gbit/s; 8 queued behind each other under 1 s here)
# not done 3 s after it was posted: the host stopped reading. Counted per transfer from its own
# post: nothing else can extend it. It bounds what a stalled worker costs other sessions.
NIXL_XFER_TIMEOUT_S = 3.0
# The worker process: a NIXL agent starts in 1-3 s here; 60 s is a broken install.
NIXL_WORKER_START_S = 60.0
# A command to the worker (load, remove) answers in milliseconds; 30 s is a hung worker.
NIXL_WORKER_CALL_S = 30.0
# The watchdog pings the worker this often while it has work; a worker whose loop has not
# answered for NIXL_WORKER_HANG_S is stuck inside NIXL or UCX (seen: a peer address that passed
# the codec, a host stopped mid-transfer) and is killed like one that aborted: the calls in
# flight fail, a new worker takes the sessions. 3 s is ~100x the slowest command seen here.
NIXL_WORKER_PING_S = 0.5
NIXL_WORKER_HANG_S = 3.0
# A tenant whose metadata took the worker down, or whose host stopped reading mid-transfer, is
# refused NIXL for this long (it uses NVMe/TCP): each worker replacement fails every tenant's
# calls in flight, so one tenant cannot repeat it at will.
NIXL_CRASH_PENALTY_S = 60.0
# Restarts on its own per window: a worker that dies as it starts (a broken install, no memory)
# is not started in a loop; the next NIXL call starts it again.
NIXL_RESTARTS_MAX, NIXL_RESTART_WINDOW_S = 5, 60.0
SESSIONS_MAX = 4096  # NIXL sessions (bounded by the control server's connections_max anyway)
# Regions one session may hold: the host keeps at most NIXL_REGIONS_MAX registered and drops
# before it adds; twice that leaves room for one call's additions before its drops land.
SESSION_REGIONS_MAX = 2 * NIXL_REGIONS_MAX


_PR_SET_NAME = 15  # prctl(2): the calling thread's name in the kernel


def _os_thread_name(name: str) -> None:
    """Name the calling thread in the kernel too (/proc/PID/task/TID/comm, `top -H`): Python
    3.11 keeps thread names to itself. `dpuctl bench datapath --nixl-ab` splits the agent's CPU
    by these names (decryption threads, lanes)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the names are cosmetic
        pass


def metadata_agent_name(metadata: bytes) -> str:
    """The agent name inside NIXL metadata, checked (dpu_agent.nixl._metadata) before NIXL
    loads it, so a session cannot take over another session's name."""
    return parse_metadata(metadata).name


class WorkerLost(Exception):
    """The NIXL worker process ended while a call was using it."""


_Span = tuple[int, int, int, str]  # addr, nbytes, dev, mem


@dataclass(slots=True, kw_only=True)
class _Session:
    sid: int
    tenant: str
    remote: str
    peer: str  # the control connection's peer address ("" on the Unix socket)
    metadata: bytes  # the last metadata loaded: reloaded into a restarted worker
    # registered regions, sorted by address: starts (for bisect) and (end, dev, mem)
    starts: list[int] = field(default_factory=list)
    rest: list[tuple[int, int, str]] = field(default_factory=list)
    # reach[i]: the index of the region ending last among regions 0..i (None: recompute)
    reach: list[int] | None = None

    def add(self, addr: int, nbytes: int, dev: int, mem: str) -> None:
        self.reach = None
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and self.starts[i] == addr:
            self.rest[i] = (addr + nbytes, dev, mem)
            return
        self.starts.insert(i, addr)
        self.rest.insert(i, (addr + nbytes, dev, mem))

    def drop(self, addr: int) -> None:
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and self.starts[i] == addr:
            del self.starts[i], self.rest[i]
            self.reach = None

    def count_after(self, drop: list[list[Any]], add: list[list[Any]]) -> int:
        """The regions held once `drop`, then `add`, are applied: a drop of an address not
        held frees nothing, an add at an address held replaces it."""
        held = set(self.starts)
        held.difference_update(int(d[0]) for d in drop)
        held.update(int(a[0]) for a in add)
        return len(held)

    def find(self, addr: int, nbytes: int) -> tuple[int, str] | None:
        """(dev, mem) of a registered region holding [addr, addr+nbytes), else None. Regions
        may nest or overlap (a host registers a buffer and part of it): of the regions
        starting at or before addr, the one ending last holds the span if any does."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        reach = self.reach
        if reach is None:  # after a register call: O(regions), once
            reach, best = [], 0
            for j, (end, _, _) in enumerate(self.rest):
                if end > self.rest[best][0]:
                    best = j
                reach.append(best)
            self.reach = reach
        end, dev, mem = self.rest[reach[i]]
        return (dev, mem) if addr + nbytes <= end else None


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Any:
    """An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack socket's peer)."""
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def _is_local_session(peer: str) -> bool:
    """A control session from this machine: the Unix socket ("") or a loopback address."""
    return not peer or ipaddress.ip_address(peer.split("%", 1)[0]).is_loopback


def _is_this_machine(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Loopback, or an address of one of this machine's interfaces (bind succeeds only on
    those; nothing is sent)."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(ip), 0))
    except OSError:
        return False
    return True


def _covered(md: NixlMetadata, addr: int, nbytes: int, dev: int, mem: str) -> bool:
    """Whether the host's own NIXL registered [addr, addr+nbytes) (its metadata says so)."""
    return any(a <= addr and addr + nbytes <= a + n and d == dev and m == mem
               for a, n, d, m in md.regions)  # fmt: skip


class _Link:
    """The agent's end of one worker process: commands out, replies resolved as futures."""

    def __init__(self, name: str, shm_fd: int, shm_bytes: int, on_exit: Callable[[], None]) -> None:
        self._on_exit, self._closed = on_exit, False
        self.killed = False  # kill() asked for: the server replaced this worker
        mine, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "dpu_agent.nixl._worker", str(theirs.fileno()),
               str(shm_fd), str(shm_bytes), name]  # fmt: skip
        # Unified mode changes the layout of peers' worker addresses (attributes replaced by a
        # resource index): dpu_agent.nixl._metadata reads the default, non-unified one.
        env = {**os.environ, "UCX_UNIFIED_MODE": "n"}
        self.proc = subprocess.Popen(
            cmd, pass_fds=(theirs.fileno(), shm_fd), stdin=subprocess.DEVNULL, env=env
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self._lock = threading.Lock()
        self._pending: dict[int, cf.Future[Any]] = {}
        self._rids = itertools.count(1)
        self.alive = True
        try:
            if not self.conn.poll(NIXL_WORKER_START_S):
                raise WorkerLost(f"not ready in {NIXL_WORKER_START_S:.0f} s")
            _, _, self.metadata = self.conn.recv()
        except (EOFError, OSError, WorkerLost) as e:
            self.close()
            raise RemoteProtocolError(
                f"this agent has no NIXL data path: its NIXL worker did not start ({e})", "failed"
            ) from None
        self._reader = threading.Thread(target=self._read, name="nixl-link", daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, name="nixl-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Kill the worker when its loop stops answering while it has work."""
        _os_thread_name("nixl-watchdog")
        ping: cf.Future[Any] | None = None
        sent = 0.0
        while self.alive and not self._closed:
            time.sleep(NIXL_WORKER_PING_S)
            if ping is not None and not ping.done():
                if run_clock() - sent < NIXL_WORKER_HANG_S:
                    continue
                log.warning("nixl_worker_stuck", pid=self.proc.pid, silent_s=NIXL_WORKER_HANG_S,
                            calls_pending=len(self._pending))  # fmt: skip
                try:
                    os.kill(self.proc.pid, signal.SIGUSR1)  # its stack, into the agent's log
                    time.sleep(0.2)
                    self.proc.kill()
                except ProcessLookupError:
                    pass
                return
            ping = None
            with self._lock:
                busy = bool(self._pending)
            if busy:
                try:
                    ping, sent = self.call("ping"), run_clock()
                except WorkerLost:
                    return

    def _read(self) -> None:
        _os_thread_name("nixl-link")
        while True:
            try:
                kind, rid, value = self.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "done":  # the transfers that ended in one round of the worker's loop
                with self._lock:
                    futs = [(self._pending.pop(r, None), st) for r, st in value]
                for f, st in futs:
                    if f is not None:
                        f.set_result(st)
                continue
            with self._lock:
                fut = self._pending.pop(rid, None)
            if fut is None:
                continue
            if kind == "ok":
                fut.set_result(value)
            else:
                fut.set_exception(RemoteProtocolError(f"nixl: {value}"))
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        status = self.proc.wait()
        log.warning("nixl_worker_exited", status=status, calls_failed=len(pending))
        for fut in pending.values():
            fut.set_exception(WorkerLost(f"exit status {status}"))
        if not self._closed:
            self._on_exit()

    def call(self, *cmd: Any) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        with self._lock:
            if not self.alive:
                raise WorkerLost("the worker had stopped")
            rid = next(self._rids)
            self._pending[rid] = fut
            try:
                self.conn.send((cmd[0], rid, *cmd[1:]))
            except OSError as e:
                del self._pending[rid]
                raise WorkerLost(str(e)) from None
        return fut

    def run(self, *cmd: Any) -> Any:
        """A command's answer (load, remove, md)."""
        try:
            return self.call(*cmd).result(timeout=NIXL_WORKER_CALL_S)
        except cf.TimeoutError:
            raise RemoteProtocolError(f"nixl: worker gave no answer in {NIXL_WORKER_CALL_S} s",
                                      "failed") from None  # fmt: skip

    def kill(self) -> None:
        """End a worker that can no longer be trusted to progress (the reader then fails what
        is pending and the server starts the next one)."""
        self.killed = True
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self._closed = True
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Lane:
    """One thread's staging slots; a slot whose transfer outlived its deadline comes back only
    when the worker says the transfer ended (a NIC may still read or write it until then)."""

    def __init__(self, index: int) -> None:
        first = index * NIXL_STAGING_SLOTS
        self.free: deque[int] = deque(range(first, first + NIXL_STAGING_SLOTS))


class NixlServer:
    """The NIXL data path of one dpu_agent (its NIXL agent runs in a worker process) and the
    sessions of hosts using it."""

    def __init__(self, engine: Callable[[], Any], name: str) -> None:
        self._engine = engine  # the agent's engine (it starts after this object)
        self.name = name
        self._thread = cf.ThreadPoolExecutor(
            NIXL_LANES,
            thread_name_prefix="nixl",
            initializer=_os_thread_name,
            initargs=("nixl-lane",),
        )
        self._io = cf.ThreadPoolExecutor(
            NIXL_IO_WORKERS,
            thread_name_prefix="nixl-io",
            initializer=_os_thread_name,
            initargs=("nixl-io",),
        )
        self._lock = threading.Lock()  # sessions, names, the link
        self._link: _Link | None = None
        self._shm: tuple[int, mmap.mmap, np.ndarray] | None = None
        self._sessions: dict[int, _Session] = {}
        self._names: dict[str, int] = {}  # host NIXL agent name -> session id
        self._lanes = threading.local()
        self._lane_ids = itertools.count()
        self._gates: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}
        self._penalty: dict[str, float] = {}  # tenant -> monotonic time its penalty ends
        # sessions whose nixl_connect runs -> whether their control session closed meanwhile
        # (a host that gave up on a connect waiting for the worker to start)
        self._connecting: dict[int, bool] = {}
        # host agent names a nixl_connect is loading now -> how many: a closed session's
        # forget leaves their metadata in the worker (the new session needs it)
        self._loading: dict[str, int] = {}
        self._closing = False
        self._restarts: deque[float] = deque()  # when the worker was restarted by itself

    def status(self) -> dict[str, Any]:
        """What hello says: whether hosts may use NIXL with this agent, and why not."""
        return nixl_status()

    def prestart(self) -> None:
        """Start the worker now, in the background, where NIXL loads ([nixl] prestart): a
        host's first nixl_connect otherwise waits for the start (1-5 s here, longer under load)
        inside a call its client gives up on after 5 s, and every host connecting meanwhile
        is served misses and stores nothing until it has started."""
        status = nixl_status()
        if not status["available"]:
            log.info("nixl_prestart_skipped", reason=status["reason"])
            return

        def start() -> None:
            try:
                self._worker()
            except (RemoteProtocolError, WorkerLost) as e:  # the first host's call tries again
                log.warning("nixl_prestart_failed", error=str(e))

        threading.Thread(target=start, name="nixl-prestart", daemon=True).start()

    async def handle(
        self, session_id: int, tenant: str, op: str, fields: Mapping[str, Any], peer_host: str = ""
    ) -> dict[str, Any]:
        """One NIXL op of a session; `peer_host` is the control connection's peer address ("" on
        the Unix socket): the UCX endpoints in the host's metadata must be that address."""
        gate, users = self._gates.setdefault(
            tenant, (asyncio.Semaphore(NIXL_LANES_PER_TENANT), [0])
        )
        users[0] += 1
        try:
            async with gate:  # at most NIXL_LANES_PER_TENANT lanes per tenant
                loop = asyncio.get_running_loop()
                call = getattr(self, "_" + op)
                if op == "nixl_connect":  # the one op that takes a host's first metadata
                    call = functools.partial(call, peer_host=peer_host)
                return await loop.run_in_executor(self._thread, call, session_id, tenant, fields)
        except WorkerLost as e:
            raise RemoteProtocolError(
                f"{op}: the NIXL worker process stopped during this call ({e}); it restarts: "
                "retry, or use NVMe/TCP", "failed"
            ) from None  # fmt: skip
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._gates[tenant]

    def sessions_of(self, tenant: str, *, but: int) -> list[int]:
        """The NIXL sessions of `tenant` other than `but`."""
        with self._lock:
            return [sid for sid, s in self._sessions.items() if s.tenant == tenant and sid != but]

    def session_closed(self, session_id: int) -> None:
        with self._lock:
            if session_id in self._connecting:  # its connect registers nothing when it ends
                self._connecting[session_id] = True
            s = self._sessions.get(session_id)
            # its host's name is free at once: the host reconnecting after a dropped control
            # connection was refused ("belongs to another session") while the closed
            # session's transfer still held a lane and its forget waited for one
            if s is not None and self._names.get(s.remote) == session_id:
                del self._names[s.remote]
        if s is not None:
            self._thread.submit(self._forget, session_id)

    def close(self) -> None:
        self._closing = True
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._link is not None:
                self._link.close()
                self._link = None

    # --- on a lane thread ----------------------------------------------------------------------
    def _lane(self) -> _Lane:
        lane = getattr(self._lanes, "lane", None)
        if lane is None:
            lane = self._lanes.lane = _Lane(next(self._lane_ids) % NIXL_LANES)
        return lane

    def _worker(self) -> _Link:
        """The live worker, started (or restarted, the sessions' metadata loaded again)."""
        with self._lock:
            if self._link is not None and self._link.alive:
                return self._link
            if self._closing:
                raise WorkerLost("the agent is stopping")
            try:
                load_nixl()
            except NixlUnavailable as e:
                raise RemoteProtocolError(f"this agent has no NIXL data path: {e}") from None
            if self._shm is None:
                nbytes = NIXL_LANES * NIXL_STAGING_SLOTS * NIXL_SEGMENT_BYTES
                fd = os.memfd_create("dpukv-nixl-staging")
                os.ftruncate(fd, nbytes)
                mem = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._shm = (fd, mem, np.frombuffer(mem, np.uint8))
            old, restart = self._link, self._link is not None
            if old is not None:
                old.close()
            fd, _, staging = self._shm
            self._link = link = _Link(self.name, fd, staging.nbytes, self._restart)
            log.info("nixl_started", name=self.name, pid=link.proc.pid, restart=restart,
                     staging_bytes=staging.nbytes)  # fmt: skip
            for sid, s in list(self._sessions.items()):
                try:
                    link.run("load", s.metadata)
                except (RemoteProtocolError, WorkerLost) as e:
                    log.warning("nixl_session_not_reloaded", session=sid, error=str(e))
                    self._sessions.pop(sid, None)
                    self._names.pop(s.remote, None)
            return link

    def _restart(self) -> None:
        """The worker ended by itself: start the next one now (not at the next call), so the
        sessions' metadata is back in NIXL before their next transfer."""

        now = time.monotonic()
        while self._restarts and self._restarts[0] < now - NIXL_RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= NIXL_RESTARTS_MAX:  # dying as it starts: the next call tries
            log.warning("nixl_worker_not_restarted", restarts=len(self._restarts),
                        window_s=NIXL_RESTART_WINDOW_S)  # fmt: skip
            return
        self._restarts.append(now)

        def restart() -> None:
            try:
                self._worker()
            except (RemoteProtocolError, WorkerLost) as e:  # the next call tries again
                log.warning("nixl_worker_restart_failed", error=str(e))

        threading.Thread(target=restart, name="nixl-restart", daemon=True).start()

    def _stalled(self, session_id: int, tenant: str, link: _Link) -> None:
        """A transfer of this session outlived its deadline. UCX over TCP has been seen to stall
        other hosts' transfers in the same worker while one host does not read (its pending
        sends hold the transport), so the worker is replaced: the calls in flight fail (the
        shim serves them over NVMe/TCP), the new worker loads every other session, this one is
        forgotten and its tenant is refused NIXL for NIXL_CRASH_PENALTY_S."""
        if link.killed:  # another transfer of the same stall got here first
            return
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is not None:
                self._names.pop(s.remote, None)
            self._penalty[tenant] = time.monotonic() + NIXL_CRASH_PENALTY_S
        log.warning("nixl_worker_replaced", tenant=tenant, session=session_id,
                    reason="transfer past its deadline")  # fmt: skip
        link.kill()

    def _forget(self, session_id: int) -> None:
        """Drop a session and, unless another session holds or is loading its host's name
        now (the same host reconnected), that host's metadata from the worker; the check and
        the removal under the lock, so a connect loading it starts after the removal."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is None:
                return
            if self._names.get(s.remote) == session_id:
                del self._names[s.remote]
            self._remove_unheld(s.remote)

    def _remove_unheld(self, remote: str) -> None:
        """Under the lock: remove a host's metadata from the worker when no session holds it
        and no connect is loading it (best effort)."""
        link = self._link
        if remote in self._names or remote in self._loading or link is None or not link.alive:
            return
        try:
            link.run("remove", remote)
        except (RemoteProtocolError, WorkerLost) as e:  # already gone: nothing to undo
            log.info("nixl_remove_remote_failed", remote=remote, error=str(e))

    def _session(self, session_id: int) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise RemoteProtocolError("no NIXL session: send nixl_connect first")
        return s

    def _check(self, session_id: int, tenant: str, metadata: bytes, peer: str) -> NixlMetadata:
        """The parsed metadata if this session may load it (name, owner, where its UCX address
        points), else refused; nothing of it reaches NIXL here."""
        md = parse_metadata(metadata)
        self._check_endpoints(md, peer)
        if not md.name.startswith(f"dpukv.{tenant}."):
            raise RemoteProtocolError(
                f"nixl metadata: host agent {md.name!r} must be named dpukv.{tenant}.<anything> "
                "(host_shim names it so)", "forbidden"
            )  # fmt: skip
        owner = self._names.get(md.name)
        if owner is not None and owner != session_id:
            raise RemoteProtocolError(
                f"nixl: host agent {md.name!r} belongs to another session", "forbidden"
            )
        until = self._penalty.get(tenant)
        if until is not None:
            if time.monotonic() < until:
                raise RemoteProtocolError(
                    f"nixl: metadata from tenant {tenant!r} stopped the NIXL worker; NIXL "
                    f"refused for {NIXL_CRASH_PENALTY_S:.0f} s (use NVMe/TCP)", "unavailable"
                )  # fmt: skip
            del self._penalty[tenant]
        return md

    def _check_endpoints(self, md: NixlMetadata, peer: str) -> None:
        """Refuse metadata whose UCX address would make the agent's UCX connect anywhere but the
        host that sent it: every tcp endpoint must be the control session's peer address, or,
        for a session on loopback or the Unix socket, this machine itself. UCX's loopback
        entries (it connects to 127.0.0.1 when their system id is its own) count as this
        machine: from a remote session, one that UCX would find reachable is refused."""
        local = _is_local_session(peer)
        # a link-local peer carries its zone ("fe80::1%eth0"); UCX packs the bare address
        peer_ip = None if local else _unmapped(ipaddress.ip_address(peer.split("%", 1)[0]))
        own: frozenset[bytes] | None = None
        for ep in md.tcp:
            if ep.ip is None:
                if local:
                    continue
                if own is None:
                    own = self._own_system_ids()
                if ep.local_id[:8] not in own:  # another machine's loopback: UCX skips it
                    continue
                where = f"this agent's loopback (port {ep.port})"
            else:
                ip = _unmapped(ep.ip)
                if ip == peer_ip or (local and _is_this_machine(ip)):
                    continue
                where = f"{ip} port {ep.port}"
            raise RemoteProtocolError(
                f"nixl metadata: its UCX address points at {where}, not at the host of this "
                f"session ({peer or 'this machine'}); limit the host's UCX to the interface that "
                "faces the agent (UCX_NET_DEVICES)", "forbidden"
            )  # fmt: skip

    def _own_system_ids(self) -> frozenset[bytes]:
        """The system ids in the worker's own loopback entries: a peer's loopback entry with
        one of these is one UCX would connect to (on this machine)."""
        own = parse_metadata(self._worker().metadata).tcp
        return frozenset(ep.local_id[:8] for ep in own if ep.ip is None)

    def _load(self, tenant: str, md: NixlMetadata, metadata: bytes) -> None:
        link = self._worker()
        try:
            loaded = link.run("load", metadata)
        except WorkerLost:
            self._penalty[tenant] = time.monotonic() + NIXL_CRASH_PENALTY_S
            log.warning("nixl_metadata_stopped_worker", tenant=tenant, host_agent=md.name)
            raise RemoteProtocolError(
                "nixl metadata: NIXL could not load it (its worker process stopped); refused",
                "forbidden",
            ) from None
        if loaded != md.name:
            raise RemoteProtocolError(f"nixl metadata: NIXL read agent {loaded!r}, not {md.name!r}")

    def _nixl_connect(
        self, sid: int, tenant: str, f: Mapping[str, Any], *, peer_host: str
    ) -> dict[str, Any]:
        old = self._sessions.get(sid)
        if old is None and len(self._sessions) >= SESSIONS_MAX:
            raise engine_errors.LimitExceeded(f"{SESSIONS_MAX} NIXL sessions; retry later")
        with self._lock:
            self._connecting[sid] = False
        name, registered = "", False
        try:  # the worker may start in here (seconds): the host may give up meanwhile
            md = self._check(sid, tenant, f["metadata"], peer_host)
            if old is not None and old.remote != md.name:
                self._forget(sid)
            with self._lock:
                name = md.name
                self._loading[name] = self._loading.get(name, 0) + 1
            self._load(tenant, md, f["metadata"])
            reply = self._register(sid, tenant, md, f["metadata"], peer_host)
            registered = True
            return reply
        finally:
            with self._lock:
                self._connecting.pop(sid, None)
                if name:
                    if self._loading[name] == 1:
                        del self._loading[name]
                    else:
                        self._loading[name] -= 1
                    if not registered:  # loaded, or left by a closed session's forget
                        self._remove_unheld(name)

    def _register(
        self, sid: int, tenant: str, md: NixlMetadata, metadata: bytes, peer_host: str
    ) -> dict[str, Any]:
        with self._lock:
            if self._connecting.get(sid):  # closed during its connect (session_closed, under
                # this lock): registered, it would hold the host's name for good (that host's
                # next session refused NIXL) and fill SESSIONS_MAX
                raise RemoteProtocolError("nixl_connect: the session closed before it was answered")
            s = self._sessions.get(sid)
            if s is None:
                s = _Session(sid=sid, tenant=tenant, remote=md.name, peer=peer_host,
                             metadata=metadata)  # fmt: skip
                self._sessions[sid] = s
            else:
                s.metadata = metadata
            self._names[md.name] = sid
            link = self._link
        assert link is not None
        log.info("nixl_session", tenant=tenant, host_agent=md.name, session=sid)
        return {"agent": self.name, "metadata": link.metadata}

    def _nixl_register(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        md = self._check(sid, tenant, f["metadata"], s.peer)
        if md.name != s.remote:  # before NIXL loads anything: a refusal holds nothing
            raise RemoteProtocolError("nixl_register: metadata of another host agent", "forbidden")
        for i, (addr, nbytes, dev, mem) in enumerate(f["add"]):
            if not _covered(md, addr, nbytes, dev, mem):
                raise RemoteProtocolError(
                    f"add[{i}] = [{addr:#x}, {nbytes}, {dev}, {mem}] is not memory the host "
                    "agent registered with NIXL (its metadata)", "forbidden"
                )  # fmt: skip
        if s.count_after(f["drop"], f["add"]) > SESSION_REGIONS_MAX:
            raise engine_errors.LimitExceeded(
                f"session holds {len(s.starts)} NIXL regions (max {SESSION_REGIONS_MAX}); "
                "drop some (nixl_register drop) before adding more"
            )
        self._load(tenant, md, f["metadata"])
        s.metadata = f["metadata"]
        for addr, _nbytes, _dev, _mem in f["drop"]:
            s.drop(addr)
        for addr, nbytes, dev, mem in f["add"]:
            s.add(addr, nbytes, dev, mem)
        return {"regions": len(s.starts)}

    def _spans(self, s: _Session, spans: list[list[int]], what: str) -> list[_Span]:
        out = []
        for i, (addr, nbytes) in enumerate(spans):
            where = s.find(addr, nbytes)
            if where is None:
                raise RemoteProtocolError(
                    f"{what}[{i}] = [{addr:#x}, {nbytes}] is not inside a region this session "
                    "registered (nixl_register)", "forbidden"
                )  # fmt: skip
            out.append((addr, nbytes, *where))
        return out

    # --- get: decrypt into staging, verify, WRITE into the host --------------------------------
    def _nixl_get(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        targets = self._spans(s, f["targets"], "targets")
        keys = f["keys"][: len(targets)]
        if not keys:
            return {"loaded": 0, "hits": 0}
        engine = self._engine()
        mover = _Mover(self, s, tenant)
        hits, lease_id, _ = engine.lookup_lists(tenant, keys, lease=True)
        try:
            loaded, corrupt = mover.get(hits, targets)
        finally:
            if lease_id:
                engine.release(tenant, lease_id)
        if corrupt is not None:  # never served again; counted as an integrity failure
            log.warning("nixl_integrity_failure", tenant=tenant, key=corrupt.hex())
            engine.delete(tenant, corrupt)
        return {"loaded": loaded, "hits": len(hits)}

    # --- put: READ from the host into staging, hash, encrypt to the tier, commit ---------------
    def _nixl_put(self, sid: int, tenant: str, f: Mapping[str, Any]) -> dict[str, Any]:
        s = self._session(sid)
        sources = self._spans(s, f["sources"], "sources")
        keys, parents = f["keys"], f["parents"]
        if len(parents) != len(keys) or len(sources) != len(keys):
            raise RemoteProtocolError(
                f"nixl_put: {len(keys)} keys, {len(sources)} sources, {len(parents)} parents: "
                "give one of each per chunk"
            )
        if not keys:
            return {"stored": 0}
        return {"stored": _Mover(self, s, tenant).put(keys, parents, sources)}


@dataclass(slots=True)
class _Xfer:
    fut: cf.Future[Any] | None  # None: the post itself failed
    deadline: float


class _Jobs:
    """(chunk, offset, bytes) of every segment of a put, made as they are taken: the plan of a
    call never costs more memory than one chunk's position."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.ci, self.off = lengths, 0, 0

    def peek(self) -> tuple[int, int, int] | None:
        if self.ci >= len(self.lengths):
            return None
        return self.ci, self.off, min(NIXL_SEGMENT_BYTES, self.lengths[self.ci] - self.off)

    def pop(self) -> tuple[int, int, int]:
        job = self.peek()
        assert job is not None
        self.off += job[2]
        if self.off >= self.lengths[self.ci]:
            self.ci, self.off = self.ci + 1, 0
        return job


class _Mover:
    """One batch of segments through a lane's staging slots; runs on that lane's thread."""

    def __init__(self, server: NixlServer, session: _Session, tenant: str) -> None:
        self.server, self.sid = server, session.sid
        self.link = server._worker()
        assert server._shm is not None
        self.view = memoryview(server._shm[1])
        self.io = server._io
        self.remote = session.remote
        self.tenant = tenant
        self.engine = server._engine()
        self.devs = self.engine.namespaces(tenant)
        self.lane = server._lane()
        self.free = self.lane.free

    def slot(self, i: int, nbytes: int) -> memoryview:
        return self.view[i * NIXL_SEGMENT_BYTES : i * NIXL_SEGMENT_BYTES + nbytes]

    def post(self, op: str, slot: int, span: _Span, off: int, n: int) -> _Xfer:
        deadline = run_clock() + NIXL_XFER_TIMEOUT_S
        try:
            fut = self.link.call(
                "xfer", op, slot * NIXL_SEGMENT_BYTES, n, span[0] + off, span[2], span[3],
                self.remote,
            )  # fmt: skip
        except WorkerLost:
            self.free.append(slot)  # nothing was posted: the slot is free
            raise
        return _Xfer(fut, deadline)

    def state(self, x: _Xfer, slot: int) -> str:
        """DONE, PROC, ERR, or LATE: past its deadline (the host stopped reading). A LATE
        transfer's slot returns to the lane when the worker says the transfer ended, not now."""
        if x.fut is None:
            return "ERR"
        if x.fut.done():
            if x.fut.exception() is not None:
                raise x.fut.exception()  # type: ignore[misc]  # WorkerLost: the call fails
            st = str(x.fut.result())
            if st == "ERR":
                log.warning("nixl_transfer_failed", remote=self.remote)
            return st
        if run_clock() <= x.deadline:
            return "PROC"
        log.warning("nixl_transfer_timeout", remote=self.remote, timeout_s=NIXL_XFER_TIMEOUT_S)
        x.fut.add_done_callback(self.returner(slot))
        self.server._stalled(self.sid, self.tenant, self.link)
        return "LATE"

    def returner(self, slot: int) -> Callable[[cf.Future[Any]], None]:
        """A callback giving `slot` back to the lane once what used it ended."""
        free = self.free
        return lambda _fut: free.append(slot)

    def release(self, io: list[tuple[cf.Future[Any], int]], xfers: list[tuple[_Xfer, int]]) -> None:
        """After a failed call, each slot back to the lane once what used it ended."""
        for f, slot in io:
            f.add_done_callback(self.returner(slot))
        for x, slot in xfers:
            if x.fut is None:
                self.free.append(slot)
            else:
                x.fut.add_done_callback(self.returner(slot))

    def wait(self, xs: list[_Xfer], futs: list[cf.Future[Any]]) -> None:
        """Until one of these transfers or futures is done, or the first deadline passes."""
        waits = [x.fut for x in xs if x.fut is not None] + futs
        if not waits:
            return
        now = run_clock()  # run time: at most as fast as real time, so never waits too long
        timeout = max(0.0, min((x.deadline for x in xs), default=now + 1) - now) + 0.001
        cf.wait(waits, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @staticmethod
    def segments(length: int, start: int = 0) -> list[tuple[int, int]]:
        return [(off, min(NIXL_SEGMENT_BYTES, length - off))
                for off in range(start, length, NIXL_SEGMENT_BYTES)]  # fmt: skip

    @staticmethod
    def ramped(length: int) -> list[tuple[int, int]]:
        """segments(), the first one NIXL_FIRST_SEGMENT_BYTES: the wire starts sooner."""
        if length <= NIXL_FIRST_SEGMENT_BYTES:
            return [(0, length)]
        return [(0, NIXL_FIRST_SEGMENT_BYTES), *_Mover.segments(length, NIXL_FIRST_SEGMENT_BYTES)]

    @staticmethod
    def interleaved(lengths: list[int], lanes: int) -> deque[tuple[int, int, int]]:
        """(chunk, offset, bytes) of every segment, `lanes` chunks side by side (one segment of
        each in turn), each chunk's in order: the I/O threads then decrypt different chunks at
        once, where segments of one chunk would wait for each other (its hash is fed in order).
        The lengths are those of chunks stored (a get's spans must match them)."""
        jobs: deque[tuple[int, int, int]] = deque()
        for first in range(0, len(lengths), lanes):
            rows = itertools.zip_longest(*(
                [(ci, off, n) for off, n in (_Mover.ramped if first == 0 else _Mover.segments)(
                    lengths[ci])]
                for ci in range(first, min(first + lanes, len(lengths)))
            ))  # fmt: skip
            jobs.extend(job for row in rows for job in row if job is not None)
        return jobs

    def read_tier(
        self, nsid: int, lba: int, slot: int, n: int, hasher: Xxh3, prev: cf.Future[None] | None
    ) -> None:
        """Decrypt a segment into `slot` and feed its `n` bytes of plaintext to its chunk's
        `hasher`, once the chunk's previous segment `prev` has fed its own."""
        if prev is not None:  # submitted earlier to the same FIFO pool: running or done
            deadline = run_clock() + NIXL_XFER_TIMEOUT_S  # the agent's own pauses not counted
            while not prev.done() and run_clock() < deadline:
                cf.wait([prev], timeout=0.1)
            prev.result(timeout=0)  # raises if it failed or is late: the chunk is lost
        nblk = -(-n // BLOCK_SIZE)
        view, dev = self.slot(slot, nblk * BLOCK_SIZE), self.devs[nsid]
        if isinstance(dev, CryptoBlockDevice):
            dev.read_hashed_into(lba, view, hasher, n)
        else:  # a tier decrypted below us (SPDK's crypto vbdev): hash after the read
            dev.read_into(lba, view)
            hasher.update(view[:n])

    def write_tier(self, nsid: int, lba: int, slot: int, n: int) -> None:
        nblk = -(-n // BLOCK_SIZE)
        view = self.slot(slot, nblk * BLOCK_SIZE)
        view[n:] = bytes(len(view) - n)  # the tail block's padding
        self.devs[nsid].write(lba, view)

    def get(self, hits: list[list[Any]], targets: list[_Span]) -> tuple[int, bytes | None]:
        """(leading chunks written and verified, key of a chunk that failed verification)."""
        usable = 0
        while usable < len(hits) and int(hits[usable][4]) == targets[usable][1]:
            usable += 1
        lengths = [int(hits[ci][4]) for ci in range(usable)]
        jobs = self.interleaved(lengths, NIXL_IO_WORKERS)
        hashers = [Xxh3(hits[ci][0]) for ci in range(usable)]
        last: list[cf.Future[None] | None] = [None] * usable  # each chunk's latest segment
        reads: deque[tuple[cf.Future[None], int, int, int, int]] = deque()
        writes: deque[tuple[int, _Xfer, int]] = deque()  # slot, transfer, chunk
        failed = usable  # the first chunk that failed (transfer or checksum)
        corrupt = None
        stuck_since = None  # no free slot and nothing in flight: slots held by LATE transfers
        try:
            while True:
                while self.free and jobs:
                    ci, off, n = jobs.popleft()
                    if ci >= failed:
                        continue
                    slot, hit = self.free.popleft(), hits[ci]
                    last[ci] = fut = self.io.submit(
                        self.read_tier, int(hit[1]), int(hit[2]) + off // BLOCK_SIZE, slot, n,
                        hashers[ci], last[ci],
                    )  # fmt: skip
                    reads.append((fut, slot, ci, off, n))
                failed = self.reap(writes, failed, block=False)
                if reads:
                    fut, slot, ci, off, n = reads[0]
                    if not fut.done():  # keep the wire moving while the tier read decrypts
                        self.wait([w[1] for w in writes][:1], [fut])
                        continue
                    reads.popleft()
                    if fut.exception() is not None:
                        log.warning("nixl_tier_read_failed", error=repr(fut.exception()))
                    if fut.exception() is not None or ci >= failed:
                        self.free.append(slot)
                        failed = min(failed, ci)
                        continue
                    if off + n == lengths[ci] and hashers[ci].digest() != hits[ci][5]:
                        corrupt, failed = hits[ci][0], min(failed, ci)
                        self.free.append(slot)
                        continue
                    writes.append((slot, self.post("WRITE", slot, targets[ci], off, n), ci))
                elif writes:
                    failed = self.reap(writes, failed, block=True)
                elif not any(j[0] < failed for j in jobs):
                    return failed, corrupt
                elif not self.free:  # every slot waits on a transfer to a host that stopped
                    stuck_since = stuck_since or run_clock()
                    if run_clock() - stuck_since > NIXL_XFER_TIMEOUT_S:
                        log.warning("nixl_lane_no_slot", remote=self.remote)
                        return failed if failed < usable else min(j[0] for j in jobs), corrupt
                    time.sleep(0.01)
        except BaseException:  # the worker stopped mid-call: give the slots back as they end
            self.release([(f, slot) for f, slot, *_ in reads], [(x, slot) for slot, x, _ in writes])
            raise

    def reap(self, writes: deque[tuple[int, _Xfer, int]], failed: int, *, block: bool) -> int:
        """Retire completed transfers (the oldest first); with `block`, at least one."""
        while writes:
            slot, x, ci = writes[0]
            st = self.state(x, slot)
            if st == "PROC":
                if block:
                    self.wait([x], [])
                    continue
                return failed
            writes.popleft()
            if st != "LATE":
                self.free.append(slot)
            if st != "DONE":
                failed = min(failed, ci)
            block = False
        return failed

    def put(self, keys: list[bytes], parents: list[bytes | None], sources: list[_Span]) -> int:
        """Reserve, READ, hash, encrypt to the tier and commit each chunk; leading stored."""
        jobs = _Jobs([span[1] for span in sources])
        res: list[Any] = []  # reservations, in chunk order
        hashers = [xxhash.xxh3_128(k) for k in keys]
        reads: deque[tuple[int, _Xfer, int, int, int]] = deque()  # slot, transfer, chunk, off, n
        writes: deque[tuple[cf.Future[None], int, int]] = deque()  # future, slot, chunk
        failed = len(keys)
        stuck_since = None
        try:
            while True:
                while self.free and (job := jobs.peek()) is not None and job[0] < failed:
                    ci, off, n = jobs.pop()
                    if off == 0 and not self.reserve(res, keys[ci], sources[ci][1], parents[ci]):
                        failed = ci
                        break
                    slot = self.free.popleft()
                    reads.append((slot, self.post("READ", slot, sources[ci], off, n), ci, off, n))
                while writes and writes[0][0].done():
                    fut, slot, ci = writes.popleft()
                    self.free.append(slot)
                    if fut.exception() is not None:
                        log.warning("nixl_put_write_failed", error=str(fut.exception()))
                        failed = min(failed, ci)
                if reads:
                    slot, x, ci, off, n = reads[0]
                    st = self.state(x, slot)
                    if st == "PROC":
                        self.wait([x], [w[0] for w in writes][:1])
                        continue
                    reads.popleft()
                    if st != "DONE" or ci >= failed:
                        if st != "LATE":
                            self.free.append(slot)
                        failed = min(failed, ci)
                        continue
                    hashers[ci].update(self.slot(slot, n))
                    nsid, lba = int(res[ci].nsid), int(res[ci].lba) + off // BLOCK_SIZE
                    writes.append((self.io.submit(self.write_tier, nsid, lba, slot, n), slot, ci))
                elif writes:
                    cf.wait([writes[0][0]])
                elif (job := jobs.peek()) is None or job[0] >= failed:
                    return self.commit(res, hashers, min(failed, len(res)))
                elif not self.free:  # every slot waits on a transfer to a host that stopped
                    stuck_since = stuck_since or run_clock()
                    if run_clock() - stuck_since > NIXL_XFER_TIMEOUT_S:
                        log.warning("nixl_lane_no_slot", remote=self.remote)
                        failed = job[0]
                    time.sleep(0.01)
        except BaseException:  # the worker stopped mid-call: nothing of it is committed
            cf.wait([fut for fut, _, _ in writes])  # tier writes end before their space is freed
            self.release([(f, slot) for f, slot, _ in writes], [(x, slot) for slot, x, *_ in reads])
            self.commit(res, hashers, 0)
            raise

    def reserve(self, res: list[Any], key: bytes, length: int, parent: bytes | None) -> bool:
        try:
            res.append(self.engine.reserve(self.tenant, key, length, parent=parent))
        except engine_errors.EngineError as e:  # full, over quota: the prefix ends here
            log.info("nixl_put_reserve_refused", tenant=self.tenant, error=str(e))
            return False
        return True

    def commit(self, res: list[Any], hashers: list[Any], stored: int) -> int:
        """Commit the leading chunks that arrived whole; give the other reservations back."""
        for ci, r in enumerate(res):
            if ci < stored:
                try:
                    self.engine.commit(self.tenant, r.reservation_id, hashers[ci].digest())
                    continue
                except engine_errors.EngineError as e:
                    log.info("nixl_put_commit_refused", tenant=self.tenant, error=str(e))
                    stored = ci
            try:
                self.engine.abort(self.tenant, r.reservation_id)
            except engine_errors.EngineError:
                pass  # expired already: nothing to give back
        return stored
