"""The control channel: one authenticated session of kvproto.control frames over TCP, TLS or a
Unix socket. KVClient runs on it, and so does `dpuctl` for admin commands, which is why it has a
module of its own: it imports no data-path code (NVMe/TCP, numpy), so a `dpuctl status` stays
quick. Transport failures raise AgentUnreachable; error replies raise ControlError with the
agent's code and message.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvproto.control import (
    NEED_DATA,
    PROTOCOL_VERSION,
    STATS_TENANTS_PAGE_MAX,
    TENANTS_MAX,
    FrameDecoder,
    ProtocolError,
    Reply,
    encode_request,
    parse_reply,
)

__all__ = [
    "PIPELINE_BYTES_MAX",
    "PIPELINE_DEPTH_MAX",
    "AgentUnreachable",
    "ControlChannel",
    "ControlError",
    "client_tls_context",
    "new_hostnqn",
    "parse_control_url",
]

RECV_BYTES_MAX = 256 << 10
# Requests sent ahead before reading replies: bounded so the agent's replies (small) never fill
# both socket buffers while we are still sending.
PIPELINE_DEPTH_MAX = 256
PIPELINE_BYTES_MAX = 128 << 10  # well under loopback and LAN socket buffers


class ControlError(Exception):
    """The agent answered with an error; `code` is kvproto.control.ErrorCode's value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AgentUnreachable(ControlError):
    """The agent cannot be reached or the connection broke (a miss, not a crash, for callers)."""

    def __init__(self, message: str) -> None:
        super().__init__("unreachable", message)


def parse_control_url(url: str) -> tuple[str, str | tuple[str, int]]:
    """'tcp://host:port' -> ('tcp', (host, port)); 'unix:///path' -> ('unix', '/path')."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        path = parts.path or parts.netloc
        if not path:
            raise ValueError(f"control URL {url!r} has no socket path; use unix:///path")
        return "unix", path
    if parts.scheme in ("tcp", "tls"):  # tls://: the agent's [control] tls_cert is set
        if not parts.hostname or parts.port is None:
            raise ValueError(f"control URL {url!r} needs a host and port: tcp://127.0.0.1:7400")
        return parts.scheme, (parts.hostname, parts.port)
    raise ValueError(f"control URL {url!r}: scheme must be tcp://, tls:// or unix://")


def parse_client_url(url: str) -> list[str]:
    """The control URLs a client URL names: one agent, or the seeds of a cluster.

    ``tcp://host:port``, ``tls://host:port``, ``unix:///path``: one agent (a list of one
    URL, no comma). A comma makes a cluster URL: ``tcp://a:7400,b:7400`` (seeds after the
    first take its scheme), ``tcp://a:7400,tcp://b:7400``, ``tcp://[::1]:7400,[::1]:7401``,
    and ``tcp://seed:7400,`` (one seed, still a cluster). ValueError for anything else.
    """
    if "," not in url:
        parse_control_url(url)
        return [url]
    parts = [u.strip() for u in url.split(",")]
    seeds = [u for u in parts if u]
    if not seeds:
        raise ValueError(f"cluster URL {url!r} names no seed; tcp://host:port,host:port")
    if "://" not in seeds[0]:
        raise ValueError(
            f"cluster URL {url!r}: the first seed needs a scheme (tcp://, tls:// or unix://); "
            "later seeds may omit it: tcp://a:7400,b:7400"
        )
    scheme = seeds[0].split("://", 1)[0]
    out = [u if "://" in u else f"{scheme}://{u}" for u in seeds]
    for u in out:
        parse_control_url(u)  # ValueError now, not mid-inference
    return out


def is_cluster_url(url: str) -> bool:
    """A comma makes a cluster URL, even with one seed (``tcp://seed:7400,``)."""
    return "," in url


def client_tls_context(cadata: str = "") -> ssl.SSLContext:
    """TLS for tls:// control URLs: `cadata` (a PEM CA, e.g. a credentials file's
    control_ca) or DPUKV_CONTROL_TLS_CA (verify the agent against it; the system's CAs when
    neither is set), DPUKV_CONTROL_TLS_CERT/_KEY (ours)."""
    if cadata:
        ctx = ssl.create_default_context(cadata=cadata)
    else:
        ctx = ssl.create_default_context(cafile=os.environ.get("DPUKV_CONTROL_TLS_CA") or None)
    cert = os.environ.get("DPUKV_CONTROL_TLS_CERT")
    if cert:
        ctx.load_cert_chain(cert, os.environ.get("DPUKV_CONTROL_TLS_KEY") or None)
    return ctx


def new_hostnqn() -> str:
    """A host NQN of the UUID form the NVMe base spec defines."""
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"


class ControlChannel:
    """One authenticated session; thread-safe (calls are serialised by a lock)."""

    def __init__(
        self,
        url: str,
        tenant: str,
        token: str,
        *,
        hostnqn: str | None = None,
        timeout_s: float = 5.0,
        client: str = "host_shim",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context` for tls:// URLs; by default one from DPUKV_CONTROL_TLS_CA (the CA or
        the agent's self-signed certificate) and DPUKV_CONTROL_TLS_CERT/_KEY (a client
        certificate, for agents that require one)."""
        self.kind, self.address = parse_control_url(url)
        self._ssl = ssl_context
        self.ssl_context = ssl_context  # what clients of the same agent or cluster reuse
        self.url, self.tenant = url, tenant
        self._token = token
        self.hostnqn = hostnqn or new_hostnqn()
        self.timeout_s = timeout_s
        self._client = client
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._recv = memoryview(bytearray(RECV_BYTES_MAX))  # reads land here (under the lock)
        self._next_id = 1
        self._unread: list[int] = []  # ids of posted requests whose replies are not read yet
        self._lock = threading.Lock()
        self.hello: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"ControlChannel({self.url!r}, tenant={self.tenant!r})"

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> dict[str, Any]:
        """Open the socket and say hello; returns the hello result."""
        with self._lock:
            self._close_locked()
            self._sock = self._open()
            self._decoder = FrameDecoder()
            fields = {
                "version": PROTOCOL_VERSION,
                "tenant": self.tenant,
                "token": self._token,
                "hostnqn": self.hostnqn,
                "client": self._client,
            }
            try:
                (reply,) = self._exchange(self._encode([("hello", fields)]))
            except ControlError:
                self._close_locked()
                raise
            if not reply.ok:
                self._close_locked()
                raise ControlError(reply.error, reply.message)
            self.hello = dict(reply.result)
            return self.hello

    def _open(self) -> socket.socket:
        family = socket.AF_UNIX if self.kind == "unix" else socket.AF_INET
        if self.kind != "unix" and ":" in self.address[0]:
            family = socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.address)
        except OSError as e:
            sock.close()
            raise AgentUnreachable(f"cannot connect to {self.url}: {e}") from None
        if self.kind != "unix":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.kind == "tls":
            try:
                ctx = self._ssl or client_tls_context()
                sock = ctx.wrap_socket(sock, server_hostname=self.address[0])
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                sock.close()
                raise AgentUnreachable(f"TLS to {self.url} failed: {e}") from None
        return sock

    def set_timeout(self, timeout_s: float) -> None:
        """How long each later read and write may wait (the session stays open): e.g. a short
        wait for the hello, a longer one for an operation known to take minutes."""
        with self._lock:
            self.timeout_s = timeout_s
            if self._sock is not None:
                self._sock.settimeout(timeout_s)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request; the result map, or ControlError with the agent's code."""
        with self._lock:  # pipeline() of one request, without its batching
            if self._sock is None:
                raise AgentUnreachable(f"not connected to {self.url}; call connect()")
            (reply,) = self._exchange(self._encode([(op, fields)]))
        if not reply.ok:
            raise ControlError(reply.error, reply.message)
        return dict(reply.result)

    def admin_stats(self) -> dict[str, Any]:
        """An admin session's `stats` over every tenant: the agent answers the per-tenant rows
        a page at a time (every tenant's would not fit a frame); the pages are joined here.
        The totals are the last page's (a tenant added between pages shows in its rows only
        if its name sorts after the pages already read)."""
        after = ""
        tenants: dict[str, Any] = {}
        for _ in range(TENANTS_MAX // STATS_TENANTS_PAGE_MAX + 2):  # names only grow: bounded
            page = self.call("stats", **({"tenants_after": after} if after else {}))
            stats = dict(page["stats"])
            tenants.update(stats.get("tenants") or {})
            after = stats.pop("tenants_next", "")
            if not after:
                break
        stats["tenants"] = tenants
        return {"stats": stats}

    def pipeline(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[Reply]:
        """Send requests ahead, then read their replies (in request order). Batches hold at
        most PIPELINE_DEPTH_MAX requests and PIPELINE_BYTES_MAX bytes, so a batch always fits
        the socket buffers while the agent answers: no deadlock with both sides writing."""
        with self._lock:
            if self._sock is None:
                raise AgentUnreachable(f"not connected to {self.url}; call connect()")
            frames = self._encode(requests)
            out: list[Reply] = []
            batch: list[tuple[int, bytes]] = []
            size = 0
            for frame in frames:
                if batch and (len(batch) >= PIPELINE_DEPTH_MAX
                              or size + len(frame[1]) > PIPELINE_BYTES_MAX):  # fmt: skip
                    out += self._exchange(batch)
                    batch, size = [], 0
                batch.append(frame)
                size += len(frame[1])
            if batch or not out:
                out += self._exchange(batch)
            return out

    def post(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Send requests whose replies nobody waits for (a release after a read): their replies
        are read and dropped before the next call's, so posting costs no round trip."""
        with self._lock:
            if self._sock is None:
                raise AgentUnreachable(f"not connected to {self.url}; call connect()")
            if len(self._unread) + len(requests) > PIPELINE_DEPTH_MAX:
                self._exchange([])  # collect what is outstanding first
            self._unread += self._send(self._encode(requests))

    def _encode(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[int, bytes]]:
        frames = []
        for op, fields in requests:
            rid = self._next_id
            self._next_id = 1 if rid >= (1 << 32) - 1 else rid + 1
            frames.append((rid, encode_request(rid, op, **fields)))
        return frames

    def _send(self, frames: Sequence[tuple[int, bytes]]) -> list[int]:
        sock = self._sock
        assert sock is not None
        try:
            sock.sendall(b"".join(f for _, f in frames))
        except OSError as e:
            self._close_locked()
            raise AgentUnreachable(f"control connection to {self.url} broke: {e}") from None
        return [rid for rid, _ in frames]

    def _exchange(self, frames: Sequence[tuple[int, bytes]]) -> list[Reply]:
        ids = self._send(frames)
        sock = self._sock
        assert sock is not None
        ids, self._unread = self._unread + ids, []
        try:
            replies = [self._read_reply(sock) for _ in ids]
        except TimeoutError:  # a stopped agent, or something else on its port
            self._close_locked()
            raise AgentUnreachable(
                f"no reply from {self.url} within {self.timeout_s:g} s"
            ) from None
        except (OSError, ProtocolError) as e:
            self._close_locked()
            raise AgentUnreachable(f"control connection to {self.url} broke: {e}") from None
        for reply, rid in zip(replies, ids, strict=True):
            if reply.id != rid:
                self._close_locked()
                if reply.id == 0 and not reply.ok:  # the agent refused the frame and closed
                    raise ControlError(reply.error, reply.message)
                raise AgentUnreachable(f"reply id {reply.id} for request {rid}: out of step")
        return replies[len(replies) - len(frames) :]  # posted requests' replies dropped

    def _read_reply(self, sock: socket.socket) -> Reply:
        while (msg := self._decoder.next_message()) is NEED_DATA:
            # into a buffer kept for the channel: recv(RECV_BYTES_MAX) allocates 256 KiB per
            # read (~10 us when malloc maps it); the decoder copies what it keeps
            nbytes = sock.recv_into(self._recv)
            if not nbytes:
                raise ConnectionResetError("agent closed the connection")
            self._decoder.receive_data(self._recv[:nbytes])
        return parse_reply(msg)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._unread = []
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
