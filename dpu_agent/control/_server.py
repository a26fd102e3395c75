"""The asyncio loop around the sans-I/O codec: TCP and Unix-socket listeners, one protocol
object per client.

Requests on one connection are answered in order (clients pipeline by sending ahead); a
malformed frame gets an error reply with id 0 and the connection is closed; a bad request in a
well-formed frame gets an error reply and the connection keeps going. Nothing one client sends
can stop the server from serving the others: input is bounded by the decoder, reading pauses
while a client leaves its replies unread or an admin op of its runs, and one connection gets
at most REQUESTS_PER_TURN_MAX requests per event-loop turn.

Connection slots are budgeted per principal: before hello a connection is a stranger, counted
from its first byte (TLS handshake included) in a small pool with a per-address share, where the
oldest stranger goes to make room, never the newcomer; after hello it holds a slot of its tenant
(TENANT_CONNECTIONS_MAX), of its address (ADDRESS_CONNECTIONS_MAX) and of the agent
(`connections_max`), and loses it after CONTROL_IDLE_S without a request.

TLS (`ssl_context`) is done here, on memory BIOs, not by asyncio: the handshake starts after
the connection is counted, is bounded by TLS_HANDSHAKE_DEADLINE_S, and costs the connection's
own small buffers only (asyncio's TLS layer takes a 256 KiB buffer per connection before any
accounting and a 60 s handshake timeout). Its crypto (the server's signature, the key exchange,
a client certificate's check) runs on TLS_HANDSHAKE_THREADS threads, not on the event loop,
and each address starts at most TLS_HANDSHAKES_PER_ADDRESS_PER_S handshakes: a flood of
ClientHellos once stalled every tenant's control calls behind its signatures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import ctypes
import functools
import itertools
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import cast

from dpu_agent.control import _metrics as m
from dpu_agent.control._auth import TenantRegistry
from dpu_agent.control._dispatch import ControlBackend, Dispatcher, Session
from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.ratelimit import TokenBuckets
from kvproto.control import (
    ADMIN_TENANT,
    CONTROL_FRAME_BYTES_MAX,
    HELLO_FRAME_BYTES_MAX,
    NEED_DATA,
    ErrorCode,
    FrameDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    SessionState,
    encode_reply,
)

__all__ = ["ControlServer"]

log = get_logger("dpu_agent.control")
refusals = RateLimitedLog(log)  # bad frames and refused connections, rate-limited

TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (linux/tcp_states.h); CLOSE_WAIT 8: the client's FIN
CONNECTIONS_MAX_DEFAULT = 1024  # authenticated TCP connections (control.connections_max)
# Authenticated TCP connections of one tenant: a quarter of connections_max, so one tenant
# leaves three quarters to the others; 256 is 32 GPU servers x 8 workers with a channel each.
TENANT_CONNECTIONS_MAX = 256
# Authenticated TCP connections from one address, all tenants together: one GPU server runs a
# few tenants' workers; half of connections_max, so one host cannot take every slot.
ADDRESS_CONNECTIONS_MAX = 512
# An authenticated connection with no request for this long is closed: its slot goes back.
# An inference server looks up on every request; 10 min is 20 lease TTLs (30 s) of silence.
CONTROL_IDLE_S = 600.0
IDLE_SWEEP_S_MAX = 30.0  # how often idle connections are looked for (at most)
# A frame's bytes all arrive within this of its first: a 1 MiB frame takes milliseconds on any
# link a GPU server uses. A tenant's connection that started a frame and trickles the rest
# (or nothing) held up to 1 MiB until CONTROL_IDLE_S (256 connections: +280 MiB for 10 min).
FRAME_DEADLINE_S = 30.0
# Connections that have not said hello yet: nobody knows who they are, so they get their own,
# smaller pool (a burst of clients starting at once is far below it) and a deadline.
UNAUTHENTICATED_MAX = 256
UNAUTHENTICATED_PER_ADDRESS_MAX = 32  # one host's clients starting together
HELLO_DEADLINE_S = 10.0  # a client says hello in its first round trip; 10 s on a loaded box
# A TLS handshake is two round trips and ~1 ms of crypto; 5 s leaves room on a loaded 2-core
# box and keeps a stalled handshake's buffers (~50 KiB) for at most that long.
TLS_HANDSHAKE_DEADLINE_S = 5.0
# Threads running TLS handshake steps (do_handshake: the server's signature, the key exchange,
# a client certificate's check; ~1 ms with ECDSA P-256, ~10 ms with RSA-4096 here) off the
# event loop: 2 are the DPU's spare cores; more would take them from the data path.
TLS_HANDSHAKE_THREADS = 2
# New TLS handshakes one address may start per second, with a burst of one host's clients
# starting together (UNAUTHENTICATED_PER_ADDRESS_MAX): legit clients handshake once per
# connection and keep it; a flood from one address past this is closed at its first byte.
TLS_HANDSHAKES_PER_ADDRESS_PER_S = 32.0
TLS_HANDSHAKE_BURST = 32.0
# Handshake steps waiting for a thread, all addresses together: past it a newcomer is closed at
# once (it retries) rather than queued behind a flood from many addresses; 64 steps are well
# under a second of crypto.
TLS_HANDSHAKE_QUEUE_MAX = 64
# Addresses whose handshake rate is remembered: past it the least recently seen is forgotten
# (a full bucket again); a flood of distinct addresses meets the queue cap.
TLS_RATE_ADDRESSES_MAX = 4096
# Strangers looked at for a silent one to close before the oldest (the per-address share): a
# bounded scan per new connection, even under a flood.
STRANGER_EVICTION_SCAN_MAX = UNAUTHENTICATED_PER_ADDRESS_MAX
# When a stranger pool that held at least this many drains, the allocator is asked to give
# the freed memory back to the OS (glibc keeps it otherwise: 256 strangers with TLS engines
# are ~16 MiB); fewer is not worth a trim.
STRANGERS_TRIM_PEAK = 64
# The Unix socket (0600: the agent's own user) has its own slots, so no TCP flood can lock the
# operator out; dpuctl uses one at a time, 64 leaves room for scripts.
UNIX_CONNECTIONS_MAX = 64
# Requests of one connection handled per event-loop turn: a client pipelining thousands of
# requests delays the others by at most this many (~64 x 100 us).
REQUESTS_PER_TURN_MAX = 64
# The event loop's time one tenant's requests may take in one round of the loop (the callbacks
# ready at once, between two looks at the sockets); past it, its connections wait for the next
# round, after the other tenants' requests that arrived meanwhile. A lookup of 4,096 keys takes
# 20-90 ms of the loop, so one round holds at most about one such request per busy tenant:
# another tenant's call waits for one of them, not for every connection the busy tenant has
# (16 connections of such lookups held another tenant's `stats` 1.1-3.3 s).
TENANT_ROUND_S = 0.02
# One read's buffer, per connection (16 MiB at 1024 connections). A lookup of 64 keys is ~1.2 KB;
# bigger frames span reads (the decoder gathers them). Reading into it spares the 256 KiB bytes
# object asyncio allocates for every data_received read; TLS records (16 KiB) fit it.
RECV_BUFFER_BYTES = 16 << 10
# A stranger's read buffer until its hello: a hello frame is ~200 bytes and a ClientHello
# ~0.5 KiB (TLS records span reads), so 256 strangers hold 1 MiB of buffers, not 4.
STRANGER_RECV_BUFFER_BYTES = 2 << 10


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where there is none (musl, macOS)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], trim)


_MALLOC_TRIM = _libc_malloc_trim()


class ControlServer:
    """Listens on TCP (`host`, `port`; port 0 picks one) and optionally a Unix socket."""

    def __init__(
        self,
        backend: ControlBackend,
        registry: TenantRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 7400,
        unix_path: str | os.PathLike[str] | None = None,
        connections_max: int = CONNECTIONS_MAX_DEFAULT,
        ssl_context: ssl.SSLContext | None = None,
        fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`ssl_context`: TLS on the TCP listener (dpu_agent/control_tls.py); Unix stays local."""
        self._ssl = ssl_context
        assert connections_max > 0, connections_max
        self.dispatcher = Dispatcher(backend, registry)
        self.dispatcher.admission = self._admission
        # A broken invariant (AssertionError) while handling a request: the agent's hook
        # exits the process; without one it propagates (tests see it).
        self.fatal = fatal or _reraise
        self._host, self._port = host, port
        self._unix_path = Path(unix_path) if unix_path else None
        self.connections_max = connections_max
        self.tenant_connections_max = max(1, min(TENANT_CONNECTIONS_MAX, connections_max // 4))
        self.address_connections_max = max(1, min(ADDRESS_CONNECTIONS_MAX, connections_max // 2))
        self._servers: list[asyncio.base_events.Server] = []
        self._sweeper: asyncio.Task[None] | None = None
        self.connections: set[_Connection] = set()
        self.authenticated: set[_Connection] = set()  # TCP connections past hello
        self.unauthenticated: dict[_Connection, str] = {}  # TCP, before hello: -> peer address
        # the same, by address (oldest first): the per-address share and who goes at it
        self._unauthenticated_at: dict[str, dict[_Connection, None]] = {}
        self._per_tenant: dict[str, int] = {}  # authenticated TCP connections per tenant
        self._per_address: dict[str, int] = {}  # ... per peer address
        self._round_used: dict[str, float] = {}  # tenant -> loop seconds in this round
        self._round_armed = False  # a new round is scheduled (call_soon: the loop's next round)
        self._stranger_peak = 0  # the most strangers since the pool last drained
        self._trim: asyncio.TimerHandle | None = None
        self.unix_connections: set[_Connection] = set()
        self.tcp_address: tuple[str, int] | None = None
        self._tls_pool: cf.ThreadPoolExecutor | None = None
        if ssl_context is not None:
            self._tls_pool = cf.ThreadPoolExecutor(TLS_HANDSHAKE_THREADS,
                                                   thread_name_prefix="control-tls")  # fmt: skip
        self.tls_queued = 0  # handshake steps submitted and not yet done
        self._tls_rate = TokenBuckets(
            TLS_HANDSHAKE_BURST, TLS_HANDSHAKES_PER_ADDRESS_PER_S, TLS_RATE_ADDRESSES_MAX
        )

    def over_round(self, tenant: str) -> bool:
        """Whether `tenant` has had its TENANT_ROUND_S of this round; if so the caller waits
        for the next round, which this schedules. (A round ends only when some tenant goes
        over: a tenant that never does may be held once after 20 ms spread over many rounds,
        for one turn of the loop.)"""
        if self._round_used.get(tenant, 0.0) < TENANT_ROUND_S:
            return False
        if not self._round_armed:
            self._round_armed = True
            asyncio.get_running_loop().call_soon(self._new_round)
        return True

    def spent(self, tenant: str, seconds: float) -> None:
        self._round_used[tenant] = self._round_used.get(tenant, 0.0) + seconds

    def _new_round(self) -> None:
        self._round_used.clear()
        self._round_armed = False

    @property
    def unix_path(self) -> Path | None:
        return self._unix_path

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # plain TCP: TLS is started by each connection once it is counted (_Connection)
        tcp = await loop.create_server(lambda: _Connection(self), self._host, self._port,
                                       backlog=256)  # fmt: skip
        self._servers.append(tcp)
        sockname = tcp.sockets[0].getsockname()
        self.tcp_address = (sockname[0], sockname[1])
        if self._unix_path is not None:
            self._unix_path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self._unix_path.unlink()  # a stale socket of a previous run
            unix = await loop.create_unix_server(lambda: _Connection(self), str(self._unix_path))
            os.chmod(self._unix_path, 0o600)  # tokens still required; this limits who may try
            self._servers.append(unix)
        self._sweeper = asyncio.create_task(self._sweep_idle(), name="control-idle-sweep")
        log.info("control_listening", tcp=f"{self.tcp_address[0]}:{self.tcp_address[1]}",
                 unix=str(self._unix_path) if self._unix_path else None,
                 tls=self._ssl is not None)  # fmt: skip

    def end_tenant_sessions(self, tenant: str) -> int:
        """Close every connection of `tenant` (it was removed); returns how many."""
        ended = 0
        for conn in list(self.connections):
            s = conn.session
            if s is not None and s.tenant == tenant and not s.admin:
                conn.abort()
                ended += 1
        return ended

    def sessions_gone(self, session_ids: Iterable[int]) -> list[int]:
        """Of `session_ids`, those whose client has closed its end (or that are no longer
        connected), though a request in flight keeps the connection from reading its EOF."""
        wanted = set(session_ids)
        if not wanted:
            return []
        live = {conn.session.session_id: conn for conn in self.connections
                if conn.session is not None and conn.session.session_id in wanted}  # fmt: skip
        return sorted(sid for sid in wanted if sid not in live or live[sid].peer_gone())

    def end_host_sessions(self, tenant: str, hostnqn: str) -> int:
        """Close every connection of `tenant` bound to host `hostnqn` (it was removed)."""
        ended = 0
        for conn in list(self.connections):
            s = conn.session
            if s is not None and s.tenant == tenant and not s.admin and s.hostnqn == hostnqn:
                conn.abort()
                ended += 1
        return ended

    async def stop(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        for server in self._servers:
            await server.wait_closed()
        if self._tls_pool is not None:
            self._tls_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.sleep(0)  # let connection_lost callbacks run
        self._servers.clear()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._unix_path.unlink()

    # --- connection budgets -----------------------------------------------------------------
    def _stranger(self, conn: _Connection, address: str) -> None:
        """A new TCP connection joins the unauthenticated pool, making room first: a stranger of
        its address at that address's share, else one of all when the pool is full; the oldest
        that has sent nothing, else the oldest (_victim). A flood must outpace every new
        client's first round trip to keep one out, and silent sockets go before a client
        that is mid-handshake or mid-hello."""
        mine = self._unauthenticated_at.setdefault(address, {})
        if len(mine) >= UNAUTHENTICATED_PER_ADDRESS_MAX:
            self._evict_stranger(_victim(mine), "per_address_evicted")
        elif len(self.unauthenticated) >= UNAUTHENTICATED_MAX:
            self._evict_stranger(_victim(self.unauthenticated), "unauthenticated_evicted")
        self.unauthenticated[conn] = address
        mine[conn] = None
        self._stranger_peak = max(self._stranger_peak, len(self.unauthenticated))

    def _evict_stranger(self, conn: _Connection, reason: str) -> None:
        self._forget_stranger(conn)
        m.CONNECTIONS_REFUSED.labels(reason).inc()
        conn.abort()

    def _forget_stranger(self, conn: _Connection) -> bool:
        address = self.unauthenticated.pop(conn, None)
        if address is None:
            return False
        mine = self._unauthenticated_at.get(address)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._unauthenticated_at[address]
        if not self.unauthenticated and self._stranger_peak >= STRANGERS_TRIM_PEAK:
            self._stranger_peak = 0
            if self._trim is None and _MALLOC_TRIM is not None:  # after their buffers are freed
                self._trim = asyncio.get_running_loop().call_later(1.0, self._give_back_memory)
        return True

    def tls_admit(self, address: str) -> str | None:
        """Whether `address` may start one more TLS handshake now (None) or why not."""
        if self.tls_queued >= TLS_HANDSHAKE_QUEUE_MAX:
            return "tls_queue_max"
        if not self._tls_rate.take(address, time.monotonic()):
            return "tls_rate"
        return None

    def _give_back_memory(self) -> None:
        """A flood of strangers is over: return what their buffers took (off the loop)."""
        self._trim = None
        if _MALLOC_TRIM is not None:
            asyncio.get_running_loop().run_in_executor(None, _MALLOC_TRIM, 0)

    def _admission(self, s: Session, tenant: str) -> str | None:
        """Whether a session that just proved its token may keep a slot (None) or why not.
        The Unix socket has its own slots; the admin counts against the agent and its address."""
        if not s.peer_host:
            return None
        if len(self.authenticated) >= self.connections_max:
            return (f"agent has {self.connections_max} connections (control.connections_max); "
                    "retry later")  # fmt: skip
        held = self._per_tenant.get(tenant, 0)
        if tenant != ADMIN_TENANT and held >= self.tenant_connections_max:
            m.CONNECTIONS_REFUSED.labels("tenant_max").inc()
            return (f"tenant {tenant!r} has {self.tenant_connections_max} connections "
                    "(TENANT_CONNECTIONS_MAX); close idle clients or share channels")  # fmt: skip
        if self._per_address.get(s.peer_host, 0) >= self.address_connections_max:
            m.CONNECTIONS_REFUSED.labels("address_max").inc()
            return (f"{s.peer_host} has {self.address_connections_max} connections "
                    "(ADDRESS_CONNECTIONS_MAX); close idle clients")  # fmt: skip
        return None

    def _authenticated(self, conn: _Connection, s: Session) -> None:
        """Hello succeeded: the connection leaves the stranger pool and takes its slots."""
        if not self._forget_stranger(conn):
            return
        self.authenticated.add(conn)
        if not s.admin:
            self._per_tenant[s.tenant] = self._per_tenant.get(s.tenant, 0) + 1
        self._per_address[s.peer_host] = self._per_address.get(s.peer_host, 0) + 1

    def _closed(self, conn: _Connection, s: Session) -> None:
        self._forget_stranger(conn)
        self.unix_connections.discard(conn)
        self.connections.discard(conn)
        if conn not in self.authenticated:
            return
        self.authenticated.discard(conn)
        if not s.admin:
            _decrement(self._per_tenant, s.tenant)
        _decrement(self._per_address, s.peer_host)

    async def _sweep_idle(self) -> None:
        """Close authenticated TCP connections idle for CONTROL_IDLE_S (their slots go back),
        and those with a frame begun more than FRAME_DEADLINE_S ago."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(CONTROL_IDLE_S / 4, IDLE_SWEEP_S_MAX, FRAME_DEADLINE_S / 2))
            cutoff = loop.time() - CONTROL_IDLE_S
            for conn in [c for c in self.authenticated if c.idle_since(cutoff)]:
                m.CONNECTIONS_REFUSED.labels("idle").inc()
                refusals.warning("control_idle_closed", peer=conn.peer, idle_s=CONTROL_IDLE_S)
                conn.abort()
            cutoff = loop.time() - FRAME_DEADLINE_S
            for conn in [c for c in self.authenticated if c.frame_begun_before(cutoff)]:
                m.CONNECTIONS_REFUSED.labels("frame_deadline").inc()
                refusals.warning("control_frame_deadline", peer=conn.peer,
                                 deadline_s=FRAME_DEADLINE_S)  # fmt: skip
                conn.abort()


def _victim(strangers: Mapping[_Connection, object]) -> _Connection:
    """The stranger to close for a newcomer: among the oldest STRANGER_EVICTION_SCAN_MAX, the
    first that has sent nothing; else the oldest."""
    oldest = next(iter(strangers))
    for conn in itertools.islice(strangers, STRANGER_EVICTION_SCAN_MAX):
        if not conn.spoke:
            return conn
    return oldest


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class _Connection(asyncio.BufferedProtocol):
    """One client: frames in, replies out, in order. Reading pauses while an admin op runs or
    while the client does not read its replies (the transport's write buffer is full). With
    TLS, records go through an SSLObject on two memory BIOs."""

    def __init__(self, server: ControlServer) -> None:
        self._server = server
        self._dispatcher = server.dispatcher
        self._decoder = FrameDecoder(HELLO_FRAME_BYTES_MAX)  # CONTROL_FRAME_BYTES_MAX at hello
        self._recv = memoryview(bytearray(STRANGER_RECV_BUFFER_BYTES))  # full size at hello
        self._transport: asyncio.Transport | None = None
        self._session: Session | None = None
        self._pending: asyncio.Future[Reply] | None = None
        self._write_paused = False
        self._yielding = False  # a turn ended with requests left: reading waits for them
        self._unix = False
        self._deadline: asyncio.TimerHandle | None = None  # HELLO_DEADLINE_S
        self._tls_deadline: asyncio.TimerHandle | None = None  # TLS_HANDSHAKE_DEADLINE_S
        self._tls: ssl.SSLObject | None = None
        self._tls_in: ssl.MemoryBIO | None = None
        self._tls_out: ssl.MemoryBIO | None = None
        self._handshaken = False
        self._tls_busy = False  # a handshake step runs on a TLS thread: reading waits for it
        self._address = ""
        self._last_active = 0.0  # loop time of the last bytes received
        self._frame_since: float | None = None  # loop time the unfinished frame began
        self.spoke = False  # any bytes received (a stranger mid-handshake or mid-hello)
        self.peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        srv = self._server
        self._unix = not isinstance(peer, tuple)
        self.peer = str(peer) if peer else "unix"
        address = "" if self._unix else str(peer[0])
        self._address = address
        refusal = self._refusal()
        if refusal:
            reason, message = refusal
            m.CONNECTIONS_REFUSED.labels(reason).inc()
            refusals.warning("control_connection_refused", peer=str(peer), reason=reason)
            if srv._ssl is None:  # a TLS client could not read it before a handshake
                transport.write(_encode(Reply(id=0, ok=False, error=str(ErrorCode.FAILED),
                                              message=message)))  # fmt: skip
            transport.close()
            return
        loop = asyncio.get_running_loop()
        self._last_active = loop.time()
        srv.connections.add(self)
        if self._unix:
            srv.unix_connections.add(self)
            self._recv = memoryview(bytearray(RECV_BUFFER_BYTES))
        else:
            srv._stranger(self, address)
            self._deadline = loop.call_later(HELLO_DEADLINE_S, self._hello_deadline)
            if srv._ssl is not None:  # the TLS engine itself comes with the first byte
                self._tls_deadline = loop.call_later(TLS_HANDSHAKE_DEADLINE_S,
                                                     self._handshake_deadline)  # fmt: skip
        m.CONNECTIONS.inc()
        local = transport.get_extra_info("sockname")
        local_host = local[0] if isinstance(local, tuple) else "127.0.0.1"  # unix: a path
        self._session = self._dispatcher.new_session(self.peer, local_host, address)

    def _refusal(self) -> tuple[str, str] | None:
        """Why this new connection is refused at once (reason, message), or None. Strangers
        are never refused here: the oldest stranger makes room (ControlServer._stranger)."""
        srv = self._server
        if self._unix:
            if len(srv.unix_connections) >= UNIX_CONNECTIONS_MAX:
                return "unix_max", f"agent has {UNIX_CONNECTIONS_MAX} Unix-socket connections"
            return None
        if len(srv.authenticated) >= srv.connections_max:
            return "connections_max", (f"agent has {srv.connections_max} connections "
                                       "(control.connections_max); retry later")  # fmt: skip
        return None

    def _hello_deadline(self) -> None:
        if self in self._server.unauthenticated:
            m.CONNECTIONS_REFUSED.labels("hello_deadline").inc()
            refusals.warning("control_hello_deadline", peer=self.peer,
                             deadline_s=HELLO_DEADLINE_S)  # fmt: skip
            self.abort()

    def _handshake_deadline(self) -> None:
        if not self._handshaken:
            m.CONNECTIONS_REFUSED.labels("tls_handshake_deadline").inc()
            refusals.warning("control_tls_handshake_deadline", peer=self.peer,
                             deadline_s=TLS_HANDSHAKE_DEADLINE_S)  # fmt: skip
            self.abort()

    def idle_since(self, cutoff: float) -> bool:
        """No bytes received since loop time `cutoff`, and no admin op of its running."""
        return self._last_active < cutoff and self._pending is None

    def frame_begun_before(self, cutoff: float) -> bool:
        """A frame still incomplete that began before loop time `cutoff` (no admin op of its
        running: reading waits for those)."""
        since = self._frame_since
        pending_bytes = self._decoder.buffered_bytes
        return since is not None and since < cutoff and pending_bytes > 0 and self._pending is None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._tls_deadline):
            if timer is not None:
                timer.cancel()
        self._tls = self._tls_in = self._tls_out = None  # the TLS engine's memory goes now
        if self._session is None:
            return
        self._server._closed(self, self._session)
        m.CONNECTIONS.dec()
        if self._pending is not None:
            self._pending.cancel()
        self._dispatcher.close_session(self._session)
        self._session = None

    @property
    def session(self) -> Session | None:
        return self._session

    def peer_gone(self) -> bool:
        """Whether the client has closed its end (FIN or reset), seen on the socket itself:
        reading is paused while a request runs, so connection_lost would come only after it.
        TCP: the connection's state; a Unix socket: a peek at end of file."""
        t = self._transport
        if t is None or t.is_closing():
            return True
        sock = t.get_extra_info("socket")
        if sock is None:
            return False
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
                return info[0] != TCP_ESTABLISHED
            peek = socket.socket(fileno=sock.fileno())
            try:
                return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            finally:
                peek.detach()  # the transport's descriptor stays open
        except OSError:
            return True

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        t = self._transport
        if t is None or t.is_closing():
            return
        if self._write_paused or self._pending is not None or self._yielding or self._tls_busy:
            t.pause_reading()
        else:
            t.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv  # the decoder copies what it keeps: the buffer is free after each read

    def buffer_updated(self, nbytes: int) -> None:
        self._last_active = asyncio.get_running_loop().time()
        self.spoke = True
        if self._tls is None:
            if self._server._ssl is None or self._unix:
                self.data_received(self._recv[:nbytes])
                return
            refused = self._server.tls_admit(self._address)
            if refused is not None:  # before any crypto or TLS memory
                m.CONNECTIONS_REFUSED.labels(refused).inc()
                refusals.warning("control_tls_refused", peer=self.peer, reason=refused)
                self.abort()
                return
            self._tls_in, self._tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self._tls = self._server._ssl.wrap_bio(self._tls_in, self._tls_out, server_side=True)
        assert self._tls_in is not None
        self._tls_in.write(self._recv[:nbytes])
        self._tls_received()

    def _tls_received(self) -> None:
        """Records in the incoming BIO: the handshake's, then application data to the decoder."""
        tls, t = self._tls, self._transport
        assert tls is not None and t is not None
        if not self._handshaken:
            self._handshake_step(tls, t)
            return
        while self._tls is not None and not t.is_closing():
            try:
                # with a buffer, read() returns the count (typeshed says bytes)
                n = cast(int, tls.read(len(self._recv), self._recv))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify: the client is done
                t.close()
                break
            except (ssl.SSLError, OSError) as e:
                refusals.warning("control_tls_error", peer=self.peer, error=str(e)[:200])
                self.abort()
                break
            if not n:
                break
            self.data_received(self._recv[:n])
        self._tls_flush()

    def _handshake_step(self, tls: ssl.SSLObject, t: asyncio.Transport) -> None:
        """Run do_handshake on a TLS thread, reading paused meanwhile (nothing touches the
        BIOs while it runs); _handshake_done carries on, on the loop."""
        srv = self._server
        assert srv._tls_pool is not None
        if srv.tls_queued >= TLS_HANDSHAKE_QUEUE_MAX:
            m.CONNECTIONS_REFUSED.labels("tls_queue_max").inc()
            self.abort()
            return
        srv.tls_queued += 1
        self._tls_busy = True
        t.pause_reading()
        fut = asyncio.get_running_loop().run_in_executor(srv._tls_pool, _handshake, tls)
        fut.add_done_callback(functools.partial(self._handshake_done, tls))

    def _handshake_done(
        self, tls: ssl.SSLObject, fut: asyncio.Future[BaseException | bool]
    ) -> None:
        self._server.tls_queued -= 1
        self._tls_busy = False
        t = self._transport
        if fut.cancelled() or self._tls is not tls or t is None or t.is_closing():
            return  # closed meanwhile, or the server stopped
        done = fut.result()
        if isinstance(done, BaseException):  # not TLS, a refused certificate, ...
            m.CONNECTIONS_REFUSED.labels("tls_handshake_failed").inc()
            refusals.warning("control_tls_refused", peer=self.peer, error=str(done)[:200])
            self._tls_flush()  # the alert, so the client knows why
            t.close()
            return
        if not done:  # it waits for the client's next flight
            self._tls_flush()
            self._update_reading()
            return
        self._handshaken = True
        if self._tls_deadline is not None:
            self._tls_deadline.cancel()
        self._tls_received()  # application data that came with the last flight
        self._update_reading()

    def _tls_flush(self) -> None:
        t, out = self._transport, self._tls_out
        if t is not None and out is not None and out.pending and not t.is_closing():
            t.write(out.read())

    def data_received(self, data: bytes | memoryview) -> None:
        if self._session is None or self._session.closing:
            return
        try:
            self._decoder.receive_data(data)
        except RemoteProtocolError as e:
            self._send([self._bad_frame(e)])
            return
        self._process_or_die()

    def _process_or_die(self) -> None:
        try:
            self._process()
        except AssertionError as e:  # never answer past a broken invariant
            self.abort()
            self._server.fatal(e)

    def _process(self) -> None:
        s = self._session
        assert s is not None and self._transport is not None
        out: list[bytes] = []
        self._yielding = False
        took_frames = False
        srv = self._server
        while self._pending is None and not s.closing:
            # let other clients in, then carry on: after REQUESTS_PER_TURN_MAX requests, or
            # when this tenant has had its share of the loop's round (TENANT_ROUND_S)
            # (before hello the tenant is "": strangers share one budget)
            if len(out) >= REQUESTS_PER_TURN_MAX or srv.over_round(s.tenant):
                self._yielding = True
                asyncio.get_running_loop().call_soon(self._continue)
                break
            try:
                msg = self._decoder.next_message()
            except RemoteProtocolError as e:
                out.append(self._bad_frame(e))
                break
            if msg is NEED_DATA:
                break
            took_frames = True
            t0 = time.perf_counter()
            reply = self._dispatcher.handle(s, msg)
            srv.spent(s.tenant, time.perf_counter() - t0)
            if s.state is SessionState.READY:
                self._decoder.frame_bytes_max = CONTROL_FRAME_BYTES_MAX
            if s.state is SessionState.READY and not self._unix:
                self._server._authenticated(self, s)
                if len(self._recv) < RECV_BUFFER_BYTES:  # read into it next: free meanwhile
                    self._recv = memoryview(bytearray(RECV_BUFFER_BYTES))
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
            if isinstance(reply, Reply):
                out.append(_encode(reply))
            else:  # an admin op: later requests wait for it, in order
                self._pending = asyncio.ensure_future(reply)
                self._pending.add_done_callback(self._admin_done)
                self._update_reading()
        if not self._decoder.buffered_bytes:
            self._frame_since = None
        elif self._frame_since is None or took_frames:  # what is left began about now
            self._frame_since = asyncio.get_running_loop().time()
        self._update_reading()
        self._send(out)

    def _continue(self) -> None:
        if self._session is not None and self._transport is not None:
            self._process_or_die()

    def _admin_done(self, fut: asyncio.Future[Reply]) -> None:
        self._pending = None
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, AssertionError):
            self.abort()
            self._server.fatal(exc)
            return
        if self._session is None:
            return
        self._last_active = asyncio.get_running_loop().time()  # a long admin op is not idling
        self._send([_encode(fut.result())])
        self._update_reading()
        self._process_or_die()

    def _bad_frame(self, e: RemoteProtocolError) -> bytes:
        assert self._session is not None
        m.PROTOCOL_ERRORS.inc()
        refusals.warning("control_bad_frame", peer=self._session.peer, error=str(e)[:200])
        self._session.state = SessionState.CLOSED
        return _encode(Reply(id=0, ok=False, error=str(e.code), message=str(e)))

    def _send(self, frames: list[bytes]) -> None:
        t = self._transport
        assert t is not None
        if frames and not t.is_closing():
            if self._tls is not None:
                self._tls.write(b"".join(frames))
                self._tls_flush()
            else:
                t.write(b"".join(frames))
        if self._session is not None and self._session.closing and self._pending is None:
            if self._tls is not None and self._handshaken:
                with contextlib.suppress(ssl.SSLError, OSError):
                    self._tls.unwrap()  # close_notify: the client reads a clean end
                self._tls_flush()
            t.close()  # after the queued replies are flushed


def _handshake(tls: ssl.SSLObject) -> BaseException | bool:
    """One do_handshake step, on a TLS thread: True when done, False when it needs the client's
    next flight, else what refused it."""
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        return False
    except (ssl.SSLError, OSError) as e:
        return e
    return True


def _reraise(e: BaseException) -> None:
    raise e


def _encode(reply: Reply) -> bytes:
    """A reply frame; a result too large for one frame becomes an error saying so."""
    try:
        return encode_reply(reply)
    except LocalProtocolError as e:
        too_big = Reply(id=reply.id, ok=False, error=str(ErrorCode.FAILED),
                        message=f"reply too large: {e}; ask for less")  # fmt: skip
        return encode_reply(too_big)
