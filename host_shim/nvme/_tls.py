"""NVMe/TCP secure channel on the initiator: a blocking socket wrapped in TLS 1.3 with a PSK.

`TlsSocket` offers the calls `QueuePairSocket` makes on a socket (`sendmsg`, `recv_into`
with MSG_WAITALL, `close`), with OpenSSL reading and writing the descriptor itself (cffi
releases the GIL meanwhile). Identity and PSK follow TP 8011 as SPDK derives them:
`NVMe0R0h <hostnqn> <subnqn>` and HKDF-Expand-Label(retained PSK, "nvme-tls-psk", identity).
Timeouts stay the kernel's (SO_RCVTIMEO/SO_SNDTIMEO): an expired one surfaces as TimeoutError.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from kvproto.nvme import TlsPsk
from kvproto.nvme._openssl import TlsEngine, TlsError, TlsWantRead

__all__ = ["SEND_JOIN_BYTES_MAX", "TlsSocket", "tls_wrapper"]

# Parts of one sendmsg up to this total are joined into one TLS write (one record, one
# syscall) instead of a record each; larger data goes out part by part without a copy.
SEND_JOIN_BYTES_MAX = 64 << 10


class TlsSocket:
    """A connected TCP socket after a TLS 1.3 PSK handshake (client side)."""

    def __init__(self, sock: socket.socket, *, psk: TlsPsk, hostnqn: str, subnqn: str) -> None:
        self._sock = sock
        ident = psk.identity(hostnqn, subnqn)
        self.identity = ident
        self._eng = TlsEngine(
            server=False,
            client_psk=(ident, psk.tls_psk(hostnqn, subnqn), psk.cipher_suite),
            fd=sock.fileno(),
        )
        try:
            if not self._eng.do_handshake():
                raise TimeoutError("TLS handshake timed out")
        except TlsError as e:
            raise ConnectionRefusedError(f"TLS handshake refused ({ident}): {e}") from None

    def sendmsg(self, bufs: Sequence[Any]) -> int:
        total = sum(len(b) for b in bufs)
        try:
            if total <= SEND_JOIN_BYTES_MAX and len(bufs) > 1:
                self._eng.write(b"".join(bufs))
            else:
                for b in bufs:
                    self._eng.write(b)
        except TlsWantRead:
            raise TimeoutError("TLS write timed out") from None
        except TlsError as e:
            raise ConnectionResetError(str(e)) from None
        return total

    def recv_into(self, buf: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buf)
        view = view[: nbytes or len(view)]
        got = 0
        try:
            while got < len(view):
                got += self._eng.read_into(view[got:])
                if not flags & socket.MSG_WAITALL:
                    break
        except TlsWantRead:
            if not got:
                raise TimeoutError("TLS read timed out") from None
        except TlsError:
            if not got:
                return 0  # the peer closed the session: like a closed socket
        return got

    def fileno(self) -> int:
        return self._sock.fileno()

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def close(self) -> None:
        try:
            self._eng.shutdown()
        except OSError:
            pass
        self._eng.close()
        self._sock.close()


def tls_wrapper(psk: TlsPsk | str, hostnqn: str, subnqn: str) -> Callable[[socket.socket], Any]:
    """What `QueuePairSocket(tls=...)` calls on each new connection."""
    key = TlsPsk.parse(psk) if isinstance(psk, str) else psk

    def wrap(sock: socket.socket) -> TlsSocket:
        return TlsSocket(sock, psk=key, hostnqn=hostnqn, subnqn=subnqn)

    return wrap
