"""TLS 1.3 with an external PSK (NVMe/TCP secure channel, TP 8011) through OpenSSL and cffi.

Python's `ssl` module (3.11) cannot offer an external PSK to TLS 1.3, so this binds the
system's libssl (OpenSSL >= 1.1.1, 3.x here) in cffi ABI mode: no compiler needed, and cffi
releases the GIL around every call, so encryption runs in parallel with the event loop. The
PSK enters through the TLS 1.3 session callbacks (`SSL_set_psk_use_session_callback` on the
client, `SSL_set_psk_find_session_callback` on the server) as an `SSL_SESSION` whose master
key is the derived TLS PSK and whose cipher is TLS_AES_128_GCM_SHA256 (32-byte PSK) or
TLS_AES_256_GCM_SHA384 (48), as SPDK's posix sock and Linux's tlshd do. No certificates, no
session tickets, TLS 1.3 only.

`TlsEngine` is sans-I/O (memory BIOs: ciphertext in, plaintext out) or, with `fd=`, reads and
writes a blocking socket itself (the initiator: no copy through Python for the ciphertext).
"""

from __future__ import annotations

import ctypes.util
import threading
from collections.abc import Callable
from typing import Any

import cffi

__all__ = ["TLS_RECORD_BYTES_MAX", "PskLookup", "TlsEngine", "TlsError", "TlsWantRead"]

TLS_RECORD_BYTES_MAX = 16384  # a TLS record's plaintext (RFC 8446 5.1)

_CDEF = """
typedef ... SSL_CTX; typedef ... SSL; typedef ... SSL_METHOD; typedef ... SSL_SESSION;
typedef ... SSL_CIPHER; typedef ... BIO; typedef ... BIO_METHOD; typedef ... EVP_MD;
const SSL_METHOD *TLS_method(void);
SSL_CTX *SSL_CTX_new(const SSL_METHOD *);
void SSL_CTX_free(SSL_CTX *);
long SSL_CTX_ctrl(SSL_CTX *, int, long, void *);
int SSL_CTX_set_ciphersuites(SSL_CTX *, const char *);
uint64_t SSL_CTX_set_options(SSL_CTX *, uint64_t);
int SSL_CTX_set_num_tickets(SSL_CTX *, size_t);
SSL *SSL_new(SSL_CTX *);
void SSL_free(SSL *);
int SSL_set_fd(SSL *, int);
void SSL_set_connect_state(SSL *);
void SSL_set_accept_state(SSL *);
int SSL_do_handshake(SSL *);
int SSL_read_ex(SSL *, void *, size_t, size_t *);
int SSL_write_ex(SSL *, const void *, size_t, size_t *);
int SSL_get_error(const SSL *, int);
int SSL_shutdown(SSL *);
int SSL_pending(const SSL *);
int SSL_session_reused(const SSL *);
void SSL_set_bio(SSL *, BIO *, BIO *);
BIO *BIO_new(const BIO_METHOD *);
const BIO_METHOD *BIO_s_mem(void);
int BIO_read(BIO *, void *, int);
int BIO_write(BIO *, const void *, int);
long BIO_ctrl(BIO *, int, long, void *);
typedef int (*psk_use_cb)(SSL *, const EVP_MD *, const unsigned char **, size_t *,
                          SSL_SESSION **);
void SSL_set_psk_use_session_callback(SSL *, psk_use_cb);
typedef int (*psk_find_cb)(SSL *, const unsigned char *, size_t, SSL_SESSION **);
void SSL_set_psk_find_session_callback(SSL *, psk_find_cb);
SSL_SESSION *SSL_SESSION_new(void);
void SSL_SESSION_free(SSL_SESSION *);
int SSL_SESSION_set1_master_key(SSL_SESSION *, const unsigned char *, size_t);
int SSL_SESSION_set_cipher(SSL_SESSION *, const SSL_CIPHER *);
int SSL_SESSION_set_protocol_version(SSL_SESSION *, int);
const SSL_CIPHER *SSL_CIPHER_find(SSL *, const unsigned char *);
unsigned long ERR_get_error(void);
void ERR_error_string_n(unsigned long, char *, size_t);
void ERR_clear_error(void);
"""

_SSL_CTRL_SET_MIN_PROTO_VERSION = 123
_SSL_CTRL_SET_MAX_PROTO_VERSION = 124
_SSL_CTRL_SET_READ_AHEAD = 41
_TLS1_3_VERSION = 0x0304
_SSL_OP_NO_TICKET = 1 << 14
_BIO_C_SET_BUF_MEM_EOF_RETURN = 130
_BIO_CTRL_PENDING = 10
_SSL_ERROR_SSL, _SSL_ERROR_WANT_READ, _SSL_ERROR_WANT_WRITE = 1, 2, 3
_SSL_ERROR_SYSCALL, _SSL_ERROR_ZERO_RETURN = 5, 6
_CIPHER_IDS = {"TLS_AES_128_GCM_SHA256": b"\x13\x01", "TLS_AES_256_GCM_SHA384": b"\x13\x02"}

# Bound on first use (`_load`): parsing the declarations costs ~0.1 s, which every import of
# the initiator or the target (and so every dpuctl command) would otherwise pay.
ffi: Any = None
lib: Any = None
_use_session: Any = None
_find_session: Any = None
_LOAD_LOCK = threading.Lock()


def _load() -> None:
    global ffi, lib, _use_session, _find_session
    with _LOAD_LOCK:
        if lib is not None:
            return
        f = cffi.FFI()
        f.cdef(_CDEF)
        loaded = f.dlopen(ctypes.util.find_library("ssl") or "libssl.so.3")
        _use_session = f.callback(_USE_SIG)(_use_session_py)
        _find_session = f.callback(_FIND_SIG)(_find_session_py)
        ffi, lib = f, loaded


# PskLookup(identity) -> (tls_psk, cipher suite name) or None (unknown identity: refused)
PskLookup = Callable[[str], "tuple[bytes, str] | None"]


class TlsError(Exception):
    """The TLS session failed (handshake refused, bad record, peer closed uncleanly)."""


class TlsWantRead(Exception):
    """Not an error: the engine needs more ciphertext (memory-BIO mode)."""


def _errors() -> str:
    out = []
    buf = ffi.new("char[256]")
    while code := lib.ERR_get_error():
        lib.ERR_error_string_n(code, buf, 256)
        out.append(ffi.string(buf).decode(errors="replace"))
    return "; ".join(out) or "no OpenSSL error queued"


def _new_ctx(cipher_suites: str) -> Any:
    ctx = lib.SSL_CTX_new(lib.TLS_method())
    if ctx == ffi.NULL:
        raise TlsError(f"SSL_CTX_new: {_errors()}")
    ctx = ffi.gc(ctx, lib.SSL_CTX_free)
    lib.SSL_CTX_ctrl(ctx, _SSL_CTRL_SET_MIN_PROTO_VERSION, _TLS1_3_VERSION, ffi.NULL)
    lib.SSL_CTX_ctrl(ctx, _SSL_CTRL_SET_MAX_PROTO_VERSION, _TLS1_3_VERSION, ffi.NULL)
    lib.SSL_CTX_set_options(ctx, _SSL_OP_NO_TICKET)
    lib.SSL_CTX_set_num_tickets(ctx, 0)
    # read ahead: one recv() takes several records instead of a header and a body each
    lib.SSL_CTX_ctrl(ctx, _SSL_CTRL_SET_READ_AHEAD, 1, ffi.NULL)
    if lib.SSL_CTX_set_ciphersuites(ctx, cipher_suites.encode()) != 1:
        raise TlsError(f"cipher suites {cipher_suites}: {_errors()}")
    return ctx


_ENGINES: dict[int, TlsEngine] = {}  # SSL* address -> engine, for the C callbacks
_ENGINES_LOCK = threading.Lock()


def _engine_of(ssl: Any) -> TlsEngine | None:
    with _ENGINES_LOCK:
        return _ENGINES.get(int(ffi.cast("uintptr_t", ssl)))


def _session(ssl: Any, key: bytes, cipher: str) -> Any:
    sess = lib.SSL_SESSION_new()
    c = lib.SSL_CIPHER_find(ssl, _CIPHER_IDS[cipher])
    if (
        sess == ffi.NULL
        or c == ffi.NULL
        or lib.SSL_SESSION_set1_master_key(sess, key, len(key)) != 1
        or lib.SSL_SESSION_set_cipher(sess, c) != 1
        or lib.SSL_SESSION_set_protocol_version(sess, _TLS1_3_VERSION) != 1
    ):
        if sess != ffi.NULL:
            lib.SSL_SESSION_free(sess)
        return ffi.NULL
    return sess


_USE_SIG = "int(SSL *, const EVP_MD *, const unsigned char **, size_t *, SSL_SESSION **)"
_FIND_SIG = "int(SSL *, const unsigned char *, size_t, SSL_SESSION **)"


def _use_session_py(ssl: Any, md: Any, idp: Any, idlen: Any, sessp: Any) -> int:
    eng = _engine_of(ssl)
    if eng is None or eng._client_psk is None:
        return 0
    identity, key, cipher = eng._client_psk
    sess = _session(ssl, key, cipher)
    if sess == ffi.NULL:
        return 0
    idp[0] = eng._identity_buf
    idlen[0] = len(identity)
    sessp[0] = sess
    return 1


def _find_session_py(ssl: Any, identity: Any, identity_len: int, sessp: Any) -> int:
    sessp[0] = ffi.NULL
    eng = _engine_of(ssl)
    if eng is None or eng._lookup is None:
        return 0
    ident = bytes(ffi.buffer(identity, identity_len)).decode(errors="replace")
    try:
        found = eng._lookup(ident)
    except Exception:  # a lookup bug must not unwind through C: refuse this handshake
        found = None
    if found is None:
        eng.refused_identity = ident
        return 1  # no PSK for it: the handshake fails (we have no certificate)
    sess = _session(ssl, found[0], found[1])
    if sess == ffi.NULL:
        return 0
    eng.identity = ident
    sessp[0] = sess
    return 1


class TlsEngine:
    """One TLS 1.3 PSK session (client or server)."""

    def __init__(
        self,
        *,
        server: bool,
        client_psk: tuple[str, bytes, str] | None = None,
        lookup: PskLookup | None = None,
        fd: int | None = None,
    ) -> None:
        """Client: `client_psk` = (identity, TLS PSK, cipher suite). Server: `lookup`.
        `fd`: the engine does its own socket I/O; else memory BIOs (feed/outgoing)."""
        assert server == (lookup is not None) and server != (client_psk is not None)
        _load()
        suites = client_psk[2] if client_psk else ":".join(_CIPHER_IDS)
        self._ctx = _new_ctx(suites)
        ssl = lib.SSL_new(self._ctx)
        if ssl == ffi.NULL:
            raise TlsError(f"SSL_new: {_errors()}")
        self._ssl = ffi.gc(ssl, lib.SSL_free)
        self._client_psk = client_psk
        self._identity_buf = (
            ffi.new("unsigned char[]", client_psk[0].encode()) if client_psk else None
        )
        self._lookup = lookup
        self.identity: str | None = client_psk[0] if client_psk else None
        self.refused_identity: str | None = None
        self.handshake_done = False
        self._rbio = self._wbio = None
        if fd is not None:
            lib.SSL_set_fd(self._ssl, fd)
        else:
            self._rbio, self._wbio = lib.BIO_new(lib.BIO_s_mem()), lib.BIO_new(lib.BIO_s_mem())
            for bio in (self._rbio, self._wbio):  # empty means "want more", not EOF
                lib.BIO_ctrl(bio, _BIO_C_SET_BUF_MEM_EOF_RETURN, -1, ffi.NULL)
            lib.SSL_set_bio(self._ssl, self._rbio, self._wbio)  # the SSL owns them now
        if server:
            lib.SSL_set_psk_find_session_callback(self._ssl, _find_session)
            lib.SSL_set_accept_state(self._ssl)
        else:
            lib.SSL_set_psk_use_session_callback(self._ssl, _use_session)
            lib.SSL_set_connect_state(self._ssl)
        self._key = int(ffi.cast("uintptr_t", self._ssl))
        with _ENGINES_LOCK:
            _ENGINES[self._key] = self
        self._n = ffi.new("size_t *")

    def close(self) -> None:
        with _ENGINES_LOCK:
            _ENGINES.pop(self._key, None)

    def _check(self, ret: int, what: str) -> None:
        err = lib.SSL_get_error(self._ssl, ret)
        if err in (_SSL_ERROR_WANT_READ, _SSL_ERROR_WANT_WRITE):
            raise TlsWantRead(what)
        if err == _SSL_ERROR_ZERO_RETURN:
            raise TlsError(f"{what}: the peer closed the TLS session")
        if err == _SSL_ERROR_SYSCALL:
            raise OSError(ffi.errno, f"{what}: socket error (errno {ffi.errno})")
        reason = _errors()
        if self.refused_identity is not None:
            reason = f"no PSK for identity {self.refused_identity!r} ({reason})"
        raise TlsError(f"{what}: {reason}")

    def do_handshake(self) -> bool:
        """Advance the handshake; True once done. TlsError if refused."""
        if self.handshake_done:
            return True
        lib.ERR_clear_error()
        ret = lib.SSL_do_handshake(self._ssl)
        if ret == 1:
            if not lib.SSL_session_reused(self._ssl):  # the PSK was not used: refuse
                raise TlsError("TLS handshake completed without the PSK")
            self.handshake_done = True
            return True
        try:
            self._check(ret, "TLS handshake")
        except TlsWantRead:
            return False
        return False

    # -- memory-BIO mode ------------------------------------------------------------------

    def feed(self, ciphertext: bytes | bytearray | memoryview) -> None:
        view = memoryview(ciphertext)
        assert self._rbio is not None
        while view:
            n = lib.BIO_write(self._rbio, ffi.from_buffer(view), len(view))
            if n <= 0:
                raise TlsError("BIO_write failed")
            view = view[n:]

    def outgoing(self) -> bytearray:
        """Ciphertext waiting to be sent (memory-BIO mode), in one buffer (one copy)."""
        assert self._wbio is not None
        pending = int(lib.BIO_ctrl(self._wbio, _BIO_CTRL_PENDING, 0, ffi.NULL))
        out = bytearray(pending)
        if pending:
            n = lib.BIO_read(self._wbio, ffi.from_buffer(out), pending)
            assert n == pending, (n, pending)
        return out

    # -- both modes -----------------------------------------------------------------------

    def read_into(self, buf: memoryview) -> int:
        """Plaintext into `buf`; raises TlsWantRead when no whole record is buffered."""
        lib.ERR_clear_error()
        ret = lib.SSL_read_ex(
            self._ssl, ffi.from_buffer(buf, require_writable=True), len(buf), self._n
        )
        if ret == 1:
            return int(self._n[0])
        self._check(ret, "TLS read")
        return 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt and send (fd mode) or queue for `outgoing()` (memory mode) all of `data`."""
        view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        while view:
            lib.ERR_clear_error()
            ret = lib.SSL_write_ex(self._ssl, ffi.from_buffer(view), len(view), self._n)
            if ret != 1:
                self._check(ret, "TLS write")
            view = view[int(self._n[0]) :]

    def shutdown(self) -> None:
        """Send close_notify (best effort)."""
        lib.ERR_clear_error()
        lib.SSL_shutdown(self._ssl)
        lib.ERR_clear_error()
