"""NVMe/TCP secure channel on the target: TLS 1.3 PSK under an NvmfConnection.

A target started with `secure_channel=True` (SPDK's `nvmf_subsystem_add_listener
--secure-channel`) speaks only TLS on its listener: `TlsServerProtocol` runs the handshake
with memory BIOs (`kvproto.nvme._openssl.TlsEngine`), looks the PSK identity
`NVMe0R0h <hostnqn> <subnqn>` up in the subsystem's `host_keys`, derives the TLS PSK as
TP 8011 says, and then hands the plaintext to an ordinary `NvmfConnection`, which writes
through `_TlsTransport`. A plaintext host (its ICReq is no ClientHello) or a wrong key fails the
handshake and the connection closes; the Connect that follows must name the host and
subsystem of the identity (`tls_identity` on the connection, checked in `check_secure`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.nvmf._connection import SOCKET_BUFFER_BYTES, NvmfConnection
from dpu_agent.nvmf._host_keys import nqn_hash
from kvproto.nvme import DhchapHash, SecretFormatError, parse_identity
from kvproto.nvme._openssl import TlsEngine, TlsError, TlsWantRead

if TYPE_CHECKING:
    from dpu_agent.nvmf._subsystem import Subsystem
    from dpu_agent.nvmf._target import NvmeTcpTarget

__all__ = ["CIPHERTEXT_BUFFER_BYTES", "TlsServerProtocol", "check_secure", "psk_lookup"]

log = get_logger("dpu_agent.nvmf")
refusals = RateLimitedLog(log)  # refused handshakes: a flood costs a few lines a second

CIPHERTEXT_BUFFER_BYTES = 1 << 20  # one receive of ciphertext (a few TLS records of a PDU)
# The receive buffer while handshaking: a PSK ClientHello is a few hundred bytes; a larger
# record arrives in several reads (the engine's memory BIO joins them).
HANDSHAKE_BUFFER_BYTES = 4096
PLAINTEXT_READS_MAX = 4096  # records decrypted per receive: bounded, each <= 16 KiB
# A connection that has not finished its TLS handshake by then is closed: a real host finishes
# in one round trip (milliseconds); 10 s covers a loaded one. Counted meanwhile (the target's
# HANDSHAKES_PER_ADDRESS_MAX / HANDSHAKES_MAX), so at most that many wait this long.
HANDSHAKE_TIMEOUT_S = 10.0
ICREQ_PDU_TYPE, ICREQ_HLEN = 0x00, 128  # the first bytes of a plaintext host's ICReq
PLAINTEXT = (
    "plaintext NVMe/TCP ICReq on a secure-channel listener: the host did not start TLS (no "
    "PSK configured, or SPDK's initiator given a key whose derived TLS PSK begins 0x00: "
    "docs/NVME_AUTH.md)"
)


def psk_lookup(subsystems: Callable[[], dict[str, Subsystem]]) -> Callable[[str], Any]:
    """identity -> (TLS PSK, cipher suite) from the subsystem's host keys, or None."""

    def lookup(identity: str) -> tuple[bytes, str] | None:
        try:
            cipher_id, hostnqn, subnqn = parse_identity(identity)
        except SecretFormatError:
            return None
        sub = subsystems().get(subnqn)
        keys = sub.host_keys.get(hostnqn) if sub is not None else None
        psk = keys.psk if keys is not None else None
        if psk is None or psk.cipher_hash is not DhchapHash(cipher_id):
            return None
        return psk.tls_psk(hostnqn, subnqn), psk.cipher_suite

    return lookup


def check_secure(conn: NvmfConnection, sub: Subsystem | None, subnqn: str, hostnqn: str) -> bool:
    """Whether a Connect may proceed: a TLS connection only for the identity's host and
    subsystem; a subsystem with `secure_channel` only over TLS."""
    ident: tuple[str, str] | None = getattr(conn, "tls_identity", None)
    if ident is not None and ident != (hostnqn, subnqn):
        return False
    return not (sub is not None and sub.secure_channel and ident is None)


class _TlsTransport(asyncio.Transport):
    """What the NvmfConnection writes to: encrypts, then the real transport sends."""

    def __init__(self, outer: TlsServerProtocol) -> None:
        super().__init__()
        self._outer = outer

    def write(self, data: Any) -> None:
        o, engine = self._outer, self._outer.engine
        assert engine is not None  # made by the handshake this transport came after
        if o.transport.is_closing():
            return
        try:
            engine.write(data)
        except (TlsError, TlsWantRead):
            o.transport.close()
            return
        o.transport.write(engine.outgoing())

    def get_write_buffer_size(self) -> int:
        return self._outer.transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._outer.transport.set_write_buffer_limits(high, low)

    def is_closing(self) -> bool:
        return self._outer.transport.is_closing()

    def close(self) -> None:
        o, engine = self._outer, self._outer.engine
        if not o.transport.is_closing():
            if engine is not None:
                engine.shutdown()
                o.transport.write(engine.outgoing())
            o.transport.close()

    def abort(self) -> None:
        self._outer.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":  # no SO_RCVLOWAT/TCP_CORK: they count ciphertext, not PDUs
            return default
        return self._outer.transport.get_extra_info(name, default)


class TlsServerProtocol(asyncio.BufferedProtocol):
    """The secure-channel listener's protocol. Until its handshake is done a connection holds
    no TLS state and no NVMe state: the target counts it from accept (`handshake_started`,
    HANDSHAKES_PER_ADDRESS_MAX / HANDSHAKES_MAX), its TLS engine is made on the first byte and
    its receive buffer is one record; the 1 MiB ciphertext buffer and the NvmfConnection come
    with the finished handshake. All of it is dropped when the connection closes."""

    def __init__(self, target: NvmeTcpTarget, lookup: Callable[[str], Any]) -> None:
        self.target = target
        self._lookup = lookup
        self.inner: NvmfConnection | None = None
        self.engine: TlsEngine | None = None
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._buf = bytearray(0)
        self._peer = "?"
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False

    @property
    def handshake_done(self) -> bool:
        return self.engine is not None and self.engine.handshake_done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if not self.target.handshake_started(self, self._peer.rpartition(":")[0]):
            refusals.warning("nvmf_connection_refused", peer=self._peer, reason="CONNECTIONS_MAX")
            self.transport.abort()
            return
        self._counted = True
        sock = transport.get_extra_info("socket")
        if sock is not None:  # as NvmfConnection does for plaintext (it never sees this socket)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._expire)

    def _expire(self) -> None:
        if not self.handshake_done and not self.transport.is_closing():
            refusals.warning("nvmf_tls_refused", peer=self._peer, host="",
                             reason="handshake timeout")  # fmt: skip
            self.transport.abort()

    def abort_handshake(self) -> None:
        """The target needs this handshake's slot (a cap): close it now."""
        self._counted = False
        if not self.transport.is_closing():
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._buf:  # one record while handshaking; the full buffer once done
            size = CIPHERTEXT_BUFFER_BYTES if self.handshake_done else HANDSHAKE_BUFFER_BYTES
            self._buf = bytearray(size)
        return memoryview(self._buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self.engine is None:
            if self._buf[0] == ICREQ_PDU_TYPE and (nbytes < 3 or self._buf[2] == ICREQ_HLEN):
                # A TLS record starts 0x16: this is an NVMe/TCP ICReq sent in the clear
                refusals.warning("nvmf_tls_refused", peer=self._peer, host="", reason=PLAINTEXT)
                self.transport.close()
                return
            self.engine = TlsEngine(server=True, lookup=self._lookup)
        self.engine.feed(memoryview(self._buf)[:nbytes])
        if not self.engine.handshake_done:
            try:
                done = self.engine.do_handshake()
            except TlsError as e:
                return self._refuse(str(e))
            self.transport.write(self.engine.outgoing())
            if not done:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._uncount()
            self._buf = bytearray(0)  # get_buffer takes the full-size one from now on
            _, hostnqn, subnqn = parse_identity(self.engine.identity or "")
            self.inner = NvmfConnection(self.target)
            self.inner.tls_identity = (hostnqn, subnqn)  # type: ignore[attr-defined]
            self.inner.connection_made(_TlsTransport(self))
        self._pump()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.target.handshake_ended(self)

    def _pump(self) -> None:
        assert self.engine is not None and self.inner is not None
        for _ in range(PLAINTEXT_READS_MAX):
            if self.inner.closed:
                return
            dest = self.inner.get_buffer(-1)
            try:
                n = self.engine.read_into(dest)
            except TlsWantRead:
                break
            except (TlsError, OSError) as e:
                log.info("nvmf_tls_closed", peer=self._peer, reason=str(e))
                self.transport.close()
                return
            self.inner.buffer_updated(n)
        out = self.engine.outgoing()
        if out:
            self.transport.write(out)

    def _refuse(self, reason: str) -> None:
        assert self.engine is not None
        ident = self.engine.refused_identity
        host = ""
        if ident:
            try:
                host = nqn_hash(parse_identity(ident)[1])
            except SecretFormatError:
                host = "malformed identity"
        refusals.warning("nvmf_tls_refused", peer=self._peer, host=host, reason=reason[:200])
        self.transport.write(self.engine.outgoing())  # the alert
        self.transport.close()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._uncount()
        self._buf = bytearray(0)
        if self.engine is not None:
            self.engine.close()
        if self.inner is not None:
            self.inner.connection_lost(exc)
