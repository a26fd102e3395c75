"""DH-HMAC-CHAP on the initiator: run `kvproto.nvme.HostAuth` over a connected queue.

After each queue's Connect (admin and I/O alike, as Linux and SPDK hosts do) the host
authenticates when the controller says so (Connect response AUTHREQ.ATR, dword 0 bit 17) or
when we hold a controller key (we want the controller to prove itself). Messages go out with
Fabrics Authentication Send (in-capsule) and come back with Authentication Receive.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from host_shim.nvme._errors import NvmeError, NvmeStatusError
from host_shim.nvme._queue import QueuePairSocket, Request
from kvproto.nvme import (
    AUTH_DATA_BYTES_MAX,
    AuthError,
    Cqe,
    DhchapHash,
    DhchapSecret,
    DhGroup,
    HostAuth,
    auth_recv,
    auth_send,
)

__all__ = ["AUTH_ROUNDS_MAX", "DhchapOptions", "NvmeAuthError", "authenticate"]

AUTH_ROUNDS_MAX = 4  # Negotiate/Reply/Success2 sends: a transaction has at most three
ALL_HASHES = (DhchapHash.SHA256, DhchapHash.SHA384, DhchapHash.SHA512)
ATR_BIT = 1 << 17  # Connect response dword 0 AUTHREQ (bits 31:16) bit 1: DH-HMAC-CHAP required
_T_IDS = itertools.count(1)


class NvmeAuthError(NvmeError):
    """In-band authentication failed; `reason` is the AUTH_Failure reason when known."""

    def __init__(self, msg: str, reason: int = 0) -> None:
        super().__init__(msg)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapOptions:
    """The host's DH-HMAC-CHAP keys and what it offers (SPDK's dhchap_digests/dhgroups)."""

    key: DhchapSecret | None = None
    ctrl_key: DhchapSecret | None = None
    hashes: tuple[DhchapHash, ...] = ALL_HASHES
    dhgroups: tuple[DhGroup, ...] = field(default_factory=lambda: tuple(DhGroup))

    @classmethod
    def build(
        cls,
        key: DhchapSecret | str | None,
        ctrl_key: DhchapSecret | str | None = None,
        hashes: Sequence[DhchapHash | str] | None = None,
        dhgroups: Sequence[DhGroup | str] | None = None,
    ) -> DhchapOptions:
        """From secrets or their `DHHC-1:` strings, hashes/groups by enum or name ("sha384",
        "ffdhe2048", "null")."""

        def secret(v: DhchapSecret | str | None) -> DhchapSecret | None:
            return DhchapSecret.parse(v) if isinstance(v, str) else v

        hs = tuple(DhchapHash[_name(h)] for h in hashes) if hashes else ALL_HASHES
        gs = tuple(DhGroup[_name(g)] for g in dhgroups) if dhgroups else tuple(DhGroup)
        if ctrl_key is not None and key is None:
            raise ValueError("a controller key needs a host key (bidirectional authentication)")
        return cls(key=secret(key), ctrl_key=secret(ctrl_key), hashes=hs, dhgroups=gs)


def _name(v: DhchapHash | DhGroup | str) -> str:
    if not isinstance(v, str):
        return v.name
    name = v.upper()
    if name not in DhchapHash.__members__ and name not in DhGroup.__members__:
        raise ValueError(f"unknown DH-HMAC-CHAP hash or DH group {v!r}")
    return name


def needs_auth(cqe: Cqe, opts: DhchapOptions | None) -> bool:
    return bool(cqe.cdw0 & ATR_BIT) or (opts is not None and opts.ctrl_key is not None)


def authenticate(
    q: QueuePairSocket, opts: DhchapOptions | None, *, hostnqn: str, subnqn: str
) -> HostAuth:
    """One DH-HMAC-CHAP transaction on `q`; raises NvmeAuthError if refused."""
    if opts is None or opts.key is None:
        raise NvmeAuthError(
            f"{subnqn} requires DH-HMAC-CHAP authentication and no key was given for {hostnqn}"
        )
    host = HostAuth(
        hostnqn=hostnqn,
        subnqn=subnqn,
        key=opts.key,
        ctrl_key=opts.ctrl_key,
        hashes=opts.hashes,
        dhgroups=opts.dhgroups,
        t_id=next(_T_IDS),
    )
    out: bytes | None = host.negotiate()
    try:
        for _ in range(AUTH_ROUNDS_MAX):
            assert out is not None
            _send(q, out)
            if host.done:
                return host
            out = host.receive(_recv(q))
            if out is None and host.done:
                return host
    except AuthError as e:
        if e.failure2 is not None:
            try:
                _send(q, e.failure2)
            except NvmeError:
                pass  # the controller may already have dropped the queue
        raise NvmeAuthError(f"DH-HMAC-CHAP with {subnqn} on queue {q.qid}: {e}", e.reason) from e
    raise NvmeAuthError(f"DH-HMAC-CHAP with {subnqn} did not finish in {AUTH_ROUNDS_MAX} rounds")


def _send(q: QueuePairSocket, msg: bytes) -> None:
    data = memoryview(msg)
    req = Request(
        lambda c: auth_send(cid=c, length=len(msg)), what="Authentication Send", data_out=data
    )
    q.execute([req])
    assert req.cqe is not None
    if not req.cqe.ok:
        raise NvmeStatusError(req.what, req.cqe)


def _recv(q: QueuePairSocket) -> bytes:
    buf = bytearray(AUTH_DATA_BYTES_MAX)
    req = Request(
        lambda c: auth_recv(cid=c, length=AUTH_DATA_BYTES_MAX),
        what="Authentication Receive",
        data_in=memoryview(buf),
    )
    req.partial_ok = True  # the controller sends only the message (SPDK does)
    q.execute([req])
    assert req.cqe is not None
    if not req.cqe.ok:
        raise NvmeStatusError(req.what, req.cqe)
    return bytes(buf[: req.received])
