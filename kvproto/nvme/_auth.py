"""NVMe in-band authentication, DH-HMAC-CHAP (NVMe Base 2.x 8.13, TP 8006), sans-I/O.

Messages travel as the data of Fabrics Authentication Send (host -> controller) and
Authentication Receive (controller -> host) commands, SECP 0xE9, SPSP0 = SPSP1 = 1. One
transaction (T_ID chosen by the host):

    host                                controller
    AUTH_Negotiate (hashes, DH groups) ->
                                       <- DH-HMAC-CHAP_Challenge (hash, group, C1, S1, g^x)
    DH-HMAC-CHAP_Reply (R1, [C2, S2], g^y) ->
                                       <- DH-HMAC-CHAP_Success1 ([R2])
    [DH-HMAC-CHAP_Success2] ->                       (bidirectional only)
    AUTH_Failure1 (controller) / AUTH_Failure2 (host) end a failed transaction.

    R1 = HMAC(Kh', Ca1 || S1 || T_ID || SC_C || "HostHost" || hostnqn || 0 || subnqn)
    R2 = HMAC(Kc', Ca2 || S2 || T_ID || SC_C || "Controller" || subnqn || 0 || hostnqn)

Kh'/Kc' are the transformed secrets (`DhchapSecret.transformed`, host key with the host NQN,
controller key with the subsystem NQN), Ca = C without a DH group, else HMAC(H(g^xy), C).
Integers are little-endian; byte layouts as SPDK's `include/spdk/nvmf_spec.h` and its
`lib/nvme/nvme_auth.c` / `lib/nvmf/auth.c` compute them (our interop peer).

`HostAuth` and `ControllerAuth` are the two state machines: bytes in, bytes out, no I/O.
"""

from __future__ import annotations

import ctypes.util
import enum
import hmac
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cffi
from cryptography.hazmat.primitives import hashes

from kvproto.nvme._commands import AdminOpcode, FabricsType, data_sgl
from kvproto.nvme._ffdhe import FFDHE_PRIMES
from kvproto.nvme._secrets import DhchapHash
from kvproto.nvme._sqe import Sqe

__all__ = [
    "ALL_DHGROUPS",
    "ALL_HASHES",
    "AUTH_DATA_BYTES_MAX",
    "AUTH_SECP",
    "AuthError",
    "AuthFailure",
    "AuthFailureReason",
    "AuthMessage",
    "AuthMessageError",
    "AuthNegotiate",
    "DhGroup",
    "DhKey",
    "DhchapChallenge",
    "DhchapReply",
    "DhchapSuccess1",
    "DhchapSuccess2",
    "auth_command_ok",
    "auth_recv",
    "auth_send",
    "dhchap_response",
    "new_seqnum",
    "parse_auth_message",
]

AUTH_SECP = 0xE9  # the security protocol assigned to NVMe
AUTH_DATA_BYTES_MAX = 4096  # SPDK's and Linux's message buffer; an ffdhe8192 Reply is 1168
DESCRIPTOR_BYTES = 64
DESCRIPTORS_MAX = 8  # NAPD: one protocol (DH-HMAC-CHAP) exists; bounded so parsing is too
_ID_LIST_MAX = 30
_CDW10_AUTH = (1 << 8) | (1 << 16) | (AUTH_SECP << 24)  # SPSP0 = SPSP1 = 1, SECP

_HDR = struct.Struct("<BBxxH")  # auth_type, auth_id, t_id
_NEGOTIATE = struct.Struct("<BBxxHBB")  # + sc_c, napd
_DESCRIPTOR = struct.Struct("<BxBB30s30s")  # auth_id, halen, dhlen, hash ids, dh group ids
_CHALLENGE = struct.Struct("<BBxxHBxBBHI")  # + hl, hash_id, dhg_id, dhvlen, seqnum
_REPLY = struct.Struct("<BBxxHBxBxHI")  # + hl, cvalid, dhvlen, seqnum
_SUCCESS1 = struct.Struct("<BBxxHBxB7x")  # + hl, rvalid
_SUCCESS2 = struct.Struct("<BBxxH10x")
_FAILURE = struct.Struct("<BBxxHBB")  # + rc, rce
assert (_CHALLENGE.size, _REPLY.size, _SUCCESS1.size, _SUCCESS2.size) == (16, 16, 16, 16)
assert _DESCRIPTOR.size == DESCRIPTOR_BYTES and _NEGOTIATE.size == _FAILURE.size == 8

_TYPE_COMMON, _TYPE_DHCHAP = 0x00, 0x01
_ID_NEGOTIATE, _ID_CHALLENGE, _ID_REPLY, _ID_SUCCESS1, _ID_SUCCESS2 = 0x00, 0x01, 0x02, 0x03, 0x04
_ID_FAILURE2, _ID_FAILURE1 = 0xF0, 0xF1
_RC_FAILURE = 1


class DhGroup(enum.IntEnum):
    NULL = 0
    FFDHE2048 = 1
    FFDHE3072 = 2
    FFDHE4096 = 3
    FFDHE6144 = 4
    FFDHE8192 = 5

    @property
    def bits(self) -> int:
        return (0, 2048, 3072, 4096, 6144, 8192)[self.value]


class AuthFailureReason(enum.IntEnum):
    """Reason code explanations of AUTH_Failure1/2 (with reason code 1, "failure")."""

    FAILED = 0x01
    PROTOCOL_UNUSABLE = 0x02
    SCC_MISMATCH = 0x03
    HASH_UNUSABLE = 0x04
    DHGROUP_UNUSABLE = 0x05
    INCORRECT_PAYLOAD = 0x06
    INCORRECT_PROTOCOL_MESSAGE = 0x07


class AuthMessageError(ValueError):
    """Bytes that are not a well-formed authentication message; `reason` for the Failure."""

    def __init__(self, msg: str, reason: AuthFailureReason = AuthFailureReason.INCORRECT_PAYLOAD):
        super().__init__(msg)
        self.reason = reason


class AuthError(Exception):
    """Authentication failed on our side or the peer's. `failure2` (host only): the
    AUTH_Failure2 to send before giving up, when the protocol calls for one."""

    def __init__(
        self, msg: str, reason: AuthFailureReason, *, failure2: bytes | None = None
    ) -> None:
        super().__init__(msg)
        self.reason = reason
        self.failure2 = failure2


# -- messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthNegotiate:
    t_id: int
    hash_ids: tuple[int, ...]
    dhgroup_ids: tuple[int, ...]
    sc_c: int = 0

    def __post_init__(self) -> None:
        if not 0 < len(self.hash_ids) <= _ID_LIST_MAX or len(self.dhgroup_ids) > _ID_LIST_MAX:
            raise AuthMessageError("AUTH_Negotiate: 1..30 hash ids and 0..30 DH group ids")

    def pack(self) -> bytes:
        desc = _DESCRIPTOR.pack(
            _TYPE_DHCHAP,
            len(self.hash_ids),
            len(self.dhgroup_ids),
            bytes(self.hash_ids),
            bytes(self.dhgroup_ids),
        )
        return _NEGOTIATE.pack(_TYPE_COMMON, _ID_NEGOTIATE, self.t_id, self.sc_c, 1) + desc


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapChallenge:
    t_id: int
    hash_id: int
    dhgroup_id: int
    seqnum: int
    cval: bytes
    dhv: bytes = b""

    def pack(self) -> bytes:
        head = _CHALLENGE.pack(
            _TYPE_DHCHAP,
            _ID_CHALLENGE,
            self.t_id,
            len(self.cval),
            self.hash_id,
            self.dhgroup_id,
            len(self.dhv),
            self.seqnum,
        )
        return head + self.cval + self.dhv


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapReply:
    t_id: int
    rval: bytes
    cval: bytes  # the host's challenge to the controller (zeros when cvalid is 0)
    cvalid: bool
    seqnum: int
    dhv: bytes = b""

    def pack(self) -> bytes:
        assert len(self.cval) == len(self.rval), (len(self.cval), len(self.rval))
        head = _REPLY.pack(
            _TYPE_DHCHAP,
            _ID_REPLY,
            self.t_id,
            len(self.rval),
            int(self.cvalid),
            len(self.dhv),
            self.seqnum,
        )
        return head + self.rval + self.cval + self.dhv


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapSuccess1:
    t_id: int
    hl: int
    rval: bytes = b""  # the controller's response R2, when the host asked for one

    def pack(self) -> bytes:
        head = _SUCCESS1.pack(_TYPE_DHCHAP, _ID_SUCCESS1, self.t_id, self.hl, int(bool(self.rval)))
        return head + self.rval


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapSuccess2:
    t_id: int

    def pack(self) -> bytes:
        return _SUCCESS2.pack(_TYPE_DHCHAP, _ID_SUCCESS2, self.t_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthFailure:
    t_id: int
    reason: int
    from_controller: bool  # AUTH_Failure1 (controller) or AUTH_Failure2 (host)
    rc: int = _RC_FAILURE

    def pack(self) -> bytes:
        auth_id = _ID_FAILURE1 if self.from_controller else _ID_FAILURE2
        return _FAILURE.pack(_TYPE_COMMON, auth_id, self.t_id, self.rc, self.reason)


AuthMessage = (
    AuthNegotiate | DhchapChallenge | DhchapReply | DhchapSuccess1 | DhchapSuccess2 | AuthFailure
)


def _need(buf: bytes, n: int, what: str) -> None:
    if len(buf) < n:
        raise AuthMessageError(f"{what}: {len(buf)} bytes, needs {n}")


def _parse_negotiate(buf: bytes) -> AuthNegotiate:
    _need(buf, _NEGOTIATE.size, "AUTH_Negotiate")
    _, _, t_id, sc_c, napd = _NEGOTIATE.unpack_from(buf)
    if not 1 <= napd <= DESCRIPTORS_MAX or len(buf) != 8 + napd * DESCRIPTOR_BYTES:
        raise AuthMessageError(f"AUTH_Negotiate: {napd} descriptors in {len(buf)} bytes")
    for i in range(napd):
        auth_id, halen, dhlen, hids, dids = _DESCRIPTOR.unpack_from(buf, 8 + i * DESCRIPTOR_BYTES)
        if auth_id != _TYPE_DHCHAP:
            continue
        if not 0 < halen <= _ID_LIST_MAX or dhlen > _ID_LIST_MAX:
            raise AuthMessageError(f"AUTH_Negotiate: halen {halen}, dhlen {dhlen}")
        return AuthNegotiate(
            t_id=t_id, sc_c=sc_c, hash_ids=tuple(hids[:halen]), dhgroup_ids=tuple(dids[:dhlen])
        )
    raise AuthMessageError(
        "AUTH_Negotiate offers no DH-HMAC-CHAP", AuthFailureReason.PROTOCOL_UNUSABLE
    )


def _parse_dhchap(auth_id: int, buf: bytes) -> AuthMessage:
    if auth_id == _ID_CHALLENGE:
        _need(buf, 16, "DH-HMAC-CHAP_Challenge")
        _, _, t_id, hl, hash_id, dhg, dhvlen, seq = _CHALLENGE.unpack_from(buf)
        _need(buf, 16 + hl + dhvlen, "DH-HMAC-CHAP_Challenge")
        cval, dhv = buf[16 : 16 + hl], buf[16 + hl : 16 + hl + dhvlen]
        return DhchapChallenge(
            t_id=t_id, hash_id=hash_id, dhgroup_id=dhg, seqnum=seq, cval=cval, dhv=dhv
        )
    if auth_id == _ID_REPLY:
        _need(buf, 16, "DH-HMAC-CHAP_Reply")
        _, _, t_id, hl, cvalid, dhvlen, seq = _REPLY.unpack_from(buf)
        if len(buf) != 16 + 2 * hl + dhvlen or cvalid not in (0, 1):
            raise AuthMessageError(
                f"DH-HMAC-CHAP_Reply: {len(buf)} bytes, hl {hl}, cvalid {cvalid}"
            )
        return DhchapReply(
            t_id=t_id,
            rval=buf[16 : 16 + hl],
            cval=buf[16 + hl : 16 + 2 * hl],
            cvalid=bool(cvalid),
            seqnum=seq,
            dhv=buf[16 + 2 * hl :],
        )
    if auth_id == _ID_SUCCESS1:
        _need(buf, 16, "DH-HMAC-CHAP_Success1")
        _, _, t_id, hl, rvalid = _SUCCESS1.unpack_from(buf)
        if rvalid:
            _need(buf, 16 + hl, "DH-HMAC-CHAP_Success1")
        return DhchapSuccess1(t_id=t_id, hl=hl, rval=buf[16 : 16 + hl] if rvalid else b"")
    if auth_id == _ID_SUCCESS2:
        _need(buf, 16, "DH-HMAC-CHAP_Success2")
        return DhchapSuccess2(t_id=_HDR.unpack_from(buf)[2])
    raise AuthMessageError(
        f"unknown DH-HMAC-CHAP message id {auth_id:#x}",
        AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE,
    )


def parse_auth_message(data: bytes | bytearray | memoryview) -> AuthMessage:
    """One authentication message; raises AuthMessageError for anything else (never another
    exception: the fuzz invariant)."""
    buf = bytes(data)
    _need(buf, _HDR.size, "authentication message")
    auth_type, auth_id, _ = _HDR.unpack_from(buf)
    if auth_type == _TYPE_COMMON:
        if auth_id == _ID_NEGOTIATE:
            return _parse_negotiate(buf)
        if auth_id in (_ID_FAILURE1, _ID_FAILURE2):
            _need(buf, _FAILURE.size, "AUTH_Failure")
            _, _, t_id, rc, rce = _FAILURE.unpack_from(buf)
            return AuthFailure(
                t_id=t_id, rc=rc, reason=rce, from_controller=auth_id == _ID_FAILURE1
            )
    elif auth_type == _TYPE_DHCHAP:
        return _parse_dhchap(auth_id, buf)
    raise AuthMessageError(
        f"unknown authentication message type {auth_type:#x} id {auth_id:#x}",
        AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE,
    )


# -- commands -------------------------------------------------------------------------------


def auth_send(*, cid: int, length: int, in_capsule: bool = True) -> Sqe:
    """Fabrics Authentication Send of `length` bytes (TL)."""
    assert 0 < length <= AUTH_DATA_BYTES_MAX, length
    return Sqe(
        opcode=AdminOpcode.FABRICS,
        cid=cid,
        nsid=FabricsType.AUTH_SEND,
        sgl=data_sgl(length, in_capsule=in_capsule),
        cdw10=_CDW10_AUTH,
        cdw11=length,
    )


def auth_recv(*, cid: int, length: int = AUTH_DATA_BYTES_MAX) -> Sqe:
    """Fabrics Authentication Receive with an allocation length (AL) of `length` bytes."""
    assert 0 < length <= AUTH_DATA_BYTES_MAX, length
    return Sqe(
        opcode=AdminOpcode.FABRICS,
        cid=cid,
        nsid=FabricsType.AUTH_RECV,
        sgl=data_sgl(length, in_capsule=False),
        cdw10=_CDW10_AUTH,
        cdw11=length,
    )


def auth_command_ok(sqe: Sqe) -> bool:
    """SECP 0xE9, SPSP0 = SPSP1 = 1 (what SPDK checks), and TL/AL <= AUTH_DATA_BYTES_MAX."""
    return (sqe.cdw10 & 0xFFFFFF00) == _CDW10_AUTH and 0 < sqe.cdw11 <= AUTH_DATA_BYTES_MAX


# -- crypto ---------------------------------------------------------------------------------


# Private exponent bits per group: OpenSSL's for the named RFC 7919 groups (twice the
# group's security strength, RFC 7919 5.2 / NIST SP 800-56A), so an 8192-bit key costs two
# 400-bit exponentiations (~6 ms each here), not two of 8192 bits.
_EXPONENT_BITS = {2048: 225, 3072: 275, 4096: 325, 6144: 375, 8192: 400}

_BN_CDEF = """
typedef ... BIGNUM; typedef ... BN_CTX; typedef ... BN_MONT_CTX;
BIGNUM *BN_bin2bn(const unsigned char *, int, BIGNUM *);
int BN_bn2binpad(const BIGNUM *, unsigned char *, int);
BIGNUM *BN_new(void);
void BN_clear_free(BIGNUM *);
BN_CTX *BN_CTX_new(void);
void BN_CTX_free(BN_CTX *);
int BN_mod_exp_mont_consttime(BIGNUM *, const BIGNUM *, const BIGNUM *, const BIGNUM *,
                              BN_CTX *, BN_MONT_CTX *);
"""
_bn: Any = None  # (ffi, lib), bound on first use
_BN_LOCK = threading.Lock()


def _bn_lib() -> Any:
    global _bn
    with _BN_LOCK:
        if _bn is None:
            f = cffi.FFI()
            f.cdef(_BN_CDEF)
            _bn = f, f.dlopen(ctypes.util.find_library("crypto") or "libcrypto.so.3")
        return _bn


def _modexp(base: bytes, exponent: bytes, modulus: bytes) -> bytes:
    """base^exponent mod modulus, big-endian, padded to the modulus; constant time in the
    exponent. libcrypto through cffi, which releases the GIL: an 8192-bit DH step run in a
    thread leaves the event loop running (the `cryptography` package holds the GIL for it)."""
    ffi, lib = _bn_lib()
    nums = [lib.BN_bin2bn(b, len(b), ffi.NULL) for b in (base, exponent, modulus)]
    r, ctx = lib.BN_new(), lib.BN_CTX_new()
    try:
        if ffi.NULL in (*nums, r, ctx):
            raise MemoryError("libcrypto: BIGNUM allocation failed")
        if lib.BN_mod_exp_mont_consttime(r, nums[0], nums[1], nums[2], ctx, ffi.NULL) != 1:
            raise AuthError("DH computation failed", AuthFailureReason.FAILED)
        out = ffi.new("unsigned char[]", len(modulus))
        if lib.BN_bn2binpad(r, out, len(modulus)) != len(modulus):
            raise AuthError("DH computation failed", AuthFailureReason.FAILED)
        return bytes(ffi.buffer(out))
    finally:
        for n in (*nums, r):
            if n != ffi.NULL:
                lib.BN_clear_free(n)
        if ctx != ffi.NULL:
            lib.BN_CTX_free(ctx)


class DhKey:
    """An ephemeral key of an RFC 7919 group; public value and secret padded to the prime.

    g = 2, x random of `_EXPONENT_BITS` bits. The peer's value is checked to be in
    (1, p - 1): with a safe prime the only small subgroups are {1} and {1, p - 1} (RFC 7919
    5.1), which is all SPDK and Linux check too."""

    def __init__(self, group: DhGroup) -> None:
        assert group is not DhGroup.NULL
        self.group = group
        self._p = FFDHE_PRIMES[group.bits]
        self._size = group.bits // 8
        self._pbytes = self._p.to_bytes(self._size, "big")
        bits = _EXPONENT_BITS[group.bits]
        x = int.from_bytes(os.urandom((bits + 7) // 8), "big") >> (-bits % 8)
        self._x = (x | 1 << (bits - 1)).to_bytes((bits + 7) // 8, "big")  # exactly `bits` long
        self._y = _modexp(b"\x02", self._x, self._pbytes)

    def public_bytes(self) -> bytes:
        return self._y

    def shared_secret(self, peer: bytes) -> bytes:
        """g^xy for the peer's public value; AuthError if that value is out of range."""
        y = int.from_bytes(peer, "big")
        if not peer or len(peer) > self._size or not 1 < y < self._p - 1:
            raise AuthError("peer DH public value out of range", AuthFailureReason.FAILED)
        return _modexp(y.to_bytes(self._size, "big"), self._x, self._pbytes)


def _augment(challenge: bytes, dh_secret: bytes | None, h: DhchapHash) -> bytes:
    if dh_secret is None:
        return challenge
    digest = hashes.Hash(h.algorithm)
    digest.update(dh_secret)
    return hmac.new(digest.finalize(), challenge, h.digest_name).digest()


def dhchap_response(
    *,
    key: bytes,
    h: DhchapHash,
    challenge: bytes,
    seqnum: int,
    t_id: int,
    label: str,
    nqn1: str,
    nqn2: str,
    dh_secret: bytes | None = None,
    sc_c: int = 0,
) -> bytes:
    """HMAC(key, Ca || seqnum || T_ID || SC_C || label || nqn1 || 0 || nqn2); `key` transformed."""
    data = b"".join(
        (
            _augment(challenge, dh_secret, h),
            struct.pack("<IHB", seqnum, t_id, sc_c),
            label.encode(),
            nqn1.encode(),
            b"\0",
            nqn2.encode(),
        )
    )
    return hmac.new(key, data, h.digest_name).digest()


def new_seqnum(previous: int, rand: Callable[[int], bytes] = os.urandom) -> int:
    """The next sequence number: a random start, then +1, never 0 (as SPDK and Linux)."""
    if previous == 0:
        previous = int.from_bytes(rand(4), "little")
    return (previous + 1) & 0xFFFFFFFF or 1


ALL_HASHES = (DhchapHash.SHA256, DhchapHash.SHA384, DhchapHash.SHA512)
ALL_DHGROUPS = tuple(DhGroup)
