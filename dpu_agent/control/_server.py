"""The asyncio loop around the sans-I/O codec: TCP and Unix-socket listeners, one protocol
object per client.

Requests on one connection are answered in order (clients pipeline by sending ahead); a
malformed frame gets an error reply with id 0 and the connection is closed; a bad request in a
well-formed frame gets an error reply and the connection keeps going. Nothing one client sends
can stop the server from serving the others: input is bounded by the decoder, reading pauses
while a client leaves its replies unread or an admin op of its runs, and one connection gets
at most REQUESTS_PER_TURN_MAX requests per event-loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpu_agent.control import _metrics as m
from dpu_agent.control._auth import TenantRegistry
from dpu_agent.control._dispatch import ControlBackend, Dispatcher, Session
from dpu_agent.log import RateLimitedLog, get_logger
from kvproto.control import (
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

CONNECTIONS_MAX_DEFAULT = 1024  # authenticated TCP connections (control.connections_max)
# Connections that have not said hello yet: nobody knows who they are, so they get their own,
# smaller pool (a burst of clients starting at once is far below it) and a deadline.
UNAUTHENTICATED_MAX = 256
UNAUTHENTICATED_PER_ADDRESS_MAX = 32  # one host's clients starting together
HELLO_DEADLINE_S = 10.0  # a client says hello in its first round trip; 10 s on a loaded box
# The Unix socket (0600: the agent's own user) has its own slots, so no TCP flood can lock the
# operator out; dpuctl uses one at a time, 64 leaves room for scripts.
UNIX_CONNECTIONS_MAX = 64
# Requests of one connection handled per event-loop turn: a client pipelining thousands of
# requests delays the others by at most this many (~64 x 100 us).
REQUESTS_PER_TURN_MAX = 64
# One read's buffer, per connection (16 MiB at 1024 connections). A lookup of 64 keys is ~1.2 KB;
# bigger frames span reads (the decoder gathers them). Reading into it spares the 256 KiB bytes
# object asyncio allocates for every data_received read.
RECV_BUFFER_BYTES = 16 << 10


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
        ssl_context: Any = None,
        fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`ssl_context`: TLS on the TCP listener (dpu_agent/control_tls.py); Unix stays local."""
        self._ssl = ssl_context
        assert connections_max > 0, connections_max
        self.dispatcher = Dispatcher(backend, registry)
        # A broken invariant (AssertionError) while handling a request: the agent's hook
        # exits the process; without one it propagates (tests see it).
        self.fatal = fatal or _reraise
        self._host, self._port = host, port
        self._unix_path = Path(unix_path) if unix_path else None
        self.connections_max = connections_max
        self._servers: list[asyncio.base_events.Server] = []
        self.connections: set[_Connection] = set()
        self.authenticated: set[_Connection] = set()  # TCP connections past hello
        self.unauthenticated: dict[_Connection, str] = {}  # TCP, before hello: -> peer address
        self.unix_connections: set[_Connection] = set()
        self.tcp_address: tuple[str, int] | None = None

    @property
    def unix_path(self) -> Path | None:
        return self._unix_path

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        tcp = await loop.create_server(lambda: _Connection(self), self._host, self._port,
                                       backlog=256, ssl=self._ssl)  # fmt: skip
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
        log.info("control_listening", tcp=f"{self.tcp_address[0]}:{self.tcp_address[1]}",
                 unix=str(self._unix_path) if self._unix_path else None)  # fmt: skip

    def end_tenant_sessions(self, tenant: str) -> int:
        """Close every connection of `tenant` (it was removed); returns how many."""
        ended = 0
        for conn in list(self.connections):
            s = conn.session
            if s is not None and s.tenant == tenant and not s.admin:
                conn.abort()
                ended += 1
        return ended

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
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        for server in self._servers:
            await server.wait_closed()
        await asyncio.sleep(0)  # let connection_lost callbacks run
        self._servers.clear()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._unix_path.unlink()


class _Connection(asyncio.BufferedProtocol):
    """One client: frames in, replies out, in order. Reading pauses while an admin op runs or
    while the client does not read its replies (the transport's write buffer is full)."""

    def __init__(self, server: ControlServer) -> None:
        self._server = server
        self._dispatcher = server.dispatcher
        self._decoder = FrameDecoder()
        self._recv = memoryview(bytearray(RECV_BUFFER_BYTES))
        self._transport: asyncio.Transport | None = None
        self._session: Session | None = None
        self._pending: asyncio.Future[Reply] | None = None
        self._write_paused = False
        self._yielding = False  # a turn ended with requests left: reading waits for them
        self._unix = False
        self._deadline: asyncio.TimerHandle | None = None  # HELLO_DEADLINE_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        srv = self._server
        self._unix = not isinstance(peer, tuple)
        address = "" if self._unix else str(peer[0])
        refusal = self._refusal(address)
        if refusal:
            reason, message = refusal
            m.CONNECTIONS_REFUSED.labels(reason).inc()
            refusals.warning("control_connection_refused", peer=str(peer), reason=reason)
            transport.write(_encode(Reply(id=0, ok=False, error=str(ErrorCode.FAILED),
                                          message=message)))  # fmt: skip
            transport.close()
            return
        srv.connections.add(self)
        if self._unix:
            srv.unix_connections.add(self)
        else:
            srv.unauthenticated[self] = address
            self._deadline = asyncio.get_running_loop().call_later(
                HELLO_DEADLINE_S, self._hello_deadline
            )
        m.CONNECTIONS.inc()
        local = transport.get_extra_info("sockname")
        local_host = local[0] if isinstance(local, tuple) else "127.0.0.1"  # unix: a path
        peer_host = str(peer[0]) if isinstance(peer, tuple) else ""
        self._session = self._dispatcher.new_session(
            str(peer) if peer else "unix", local_host, peer_host
        )

    def _refusal(self, address: str) -> tuple[str, str] | None:
        """Why this new connection is refused (reason, message), or None."""
        srv = self._server
        if self._unix:
            if len(srv.unix_connections) >= UNIX_CONNECTIONS_MAX:
                return "unix_max", f"agent has {UNIX_CONNECTIONS_MAX} Unix-socket connections"
            return None
        if len(srv.authenticated) >= srv.connections_max:
            return "connections_max", (f"agent has {srv.connections_max} connections "
                                       "(control.connections_max); retry later")  # fmt: skip
        same = sum(a == address for a in srv.unauthenticated.values())
        if same >= UNAUTHENTICATED_PER_ADDRESS_MAX:
            return "per_address_max", (f"{address} has {same} connections waiting for hello; "
                                       "say hello on them first")  # fmt: skip
        if len(srv.unauthenticated) >= UNAUTHENTICATED_MAX:
            # the pool is full of strangers: the oldest goes (a client says hello within a
            # round trip; a flood must outpace every new client to keep one out)
            oldest = next(iter(srv.unauthenticated))
            srv.unauthenticated.pop(oldest)
            m.CONNECTIONS_REFUSED.labels("unauthenticated_evicted").inc()
            oldest.abort()
        return None

    def _hello_deadline(self) -> None:
        if self in self._server.unauthenticated:
            m.CONNECTIONS_REFUSED.labels("hello_deadline").inc()
            refusals.warning("control_hello_deadline", peer=self._session.peer if self._session
                             else "?", deadline_s=HELLO_DEADLINE_S)  # fmt: skip
            self.abort()

    def _authenticated(self) -> None:
        """Hello succeeded: the connection leaves the unauthenticated pool."""
        srv = self._server
        if srv.unauthenticated.pop(self, None) is not None:
            srv.authenticated.add(self)
            if self._deadline is not None:
                self._deadline.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self._session is None:
            return
        srv = self._server
        srv.authenticated.discard(self)
        srv.unauthenticated.pop(self, None)
        srv.unix_connections.discard(self)
        self._server.connections.discard(self)
        m.CONNECTIONS.dec()
        if self._pending is not None:
            self._pending.cancel()
        self._dispatcher.close_session(self._session)
        self._session = None

    @property
    def session(self) -> Session | None:
        return self._session

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
        if self._write_paused or self._pending is not None or self._yielding:
            t.pause_reading()
        else:
            t.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv  # the decoder copies what it keeps: the buffer is free after each read

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._recv[:nbytes])

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
        while self._pending is None and not s.closing:
            if len(out) >= REQUESTS_PER_TURN_MAX:  # let other clients in, then carry on
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
            reply = self._dispatcher.handle(s, msg)
            if s.state is SessionState.READY and not self._unix:
                self._authenticated()
            if isinstance(reply, Reply):
                out.append(_encode(reply))
            else:  # an admin op: later requests wait for it, in order
                self._pending = asyncio.ensure_future(reply)
                self._pending.add_done_callback(self._admin_done)
                self._update_reading()
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
            t.write(b"".join(frames))
        if self._session is not None and self._session.closing and self._pending is None:
            t.close()  # after the queued replies are flushed


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
