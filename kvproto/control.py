"""Control-plane frames: sans-I/O codec and message schema shared by the agent and the shim.

Frame layout::

    +-------------------+---------------------------------------------+
    | length: u32 BE    | msgpack map of `length` bytes               |
    +-------------------+---------------------------------------------+

`length` counts the msgpack body only and is at most CONTROL_FRAME_BYTES_MAX. A request is
``{"id": u32, "op": str, ...fields}``; a reply is ``{"id": u32, "ok": true, "result": map}`` or
``{"id": u32, "ok": false, "error": code, "message": str}``. Replies carry the request's id, so
a client may pipeline: send several requests, then read the replies (the server answers in
order per connection). Binary values (keys, checksums) are msgpack ``bin``; strings are UTF-8.

Operations (fields; every connection starts with ``hello``):

- ``hello``: version, tenant, token, [hostnqn], [client], [peer_proof] -> session, node,
  version, nvme {host, port, subnqn}, lease_ttl_s. A version mismatch is refused with code
  ``version``.
- Agent to agent (kvproto.peer_auth): ``peer_challenge``: node, nonce -> node, nonce, proof,
  before hello; then ``hello`` with an empty token and ``peer_proof`` opens a session of the
  tenant named, authorised by the cluster key instead of the tenant's token.
- ``lookup``: keys (list of 16-byte keys), [lease] -> hits (list of [key, nsid, lba,
  block_count, length, checksum], the longest cached prefix), lease_id, lease_expires_s. With
  ``lease: false`` the agent takes no lease (a probe, not a read: lease_id 0).
- ``release``: lease_id.  ``reserve``: key, length, [parent] -> reservation_id, nsid, lba,
  block_count, expires_s.  ``commit``: reservation_id, checksum.  ``abort``: reservation_id
  (give back a reservation that will not be committed).
- ``delete`` / ``pin`` / ``unpin``: key (``delete`` with ``corrupt: true`` when the reader's
  checksum check failed: the agent counts and logs an integrity failure).
- ``stats`` -> the tenant's stats.  ``members`` -> members (list of {name, control, nvme,
  capacity_bytes}); in a cluster also epoch, replicas (the session tenant's R) and each
  member's status, state and zone. With ``since`` (the client's epoch) a cluster member
  answers ``unchanged: true``, or ``changed`` (rows) and ``removed`` (names) since that
  epoch, with epoch and replicas; the whole list when it does not remember that epoch.
- Cluster: ``lookup`` and ``reserve`` may carry ``epoch`` (the client's membership epoch,
  kvproto.placement); a node whose epoch differs answers ``moved`` and the client reads
  ``members`` again (Redis Cluster's MOVED).
- Admin (a session opened with tenant ``_admin`` and the admin token): ``tenants_list``,
  ``tenant_add`` (tenant, [token], [quota_bytes]), ``tenant_remove`` (tenant),
  ``tenant_rotate`` (tenant, [token]: a new token, generated when not given), ``evict``
  (tenant, bytes), ``checkpoint``, ``backup`` (dir, incremental), ``restore`` (dirs), ``stats``
  over all tenants ([tenants_after], [tenants_limit]: the totals are over every tenant, the
  per-tenant rows a page of at most STATS_TENANTS_PAGE_MAX in name order after
  ``tenants_after``, and ``tenants_next`` the name to ask after, "" at the end; a reply over
  every tenant would not fit a frame), ``chunks_list`` (tenant, limit, [after]: a page of
  the tenant's chunks in key order after key `after`), ``chunk_inspect`` (tenant, key).
- NIXL data path (hello's ``nixl`` says whether the agent offers it): ``nixl_connect``:
  metadata (the host NIXL agent's) -> agent (the agent's NIXL name), metadata.
  ``nixl_register``: metadata (refreshed), add, drop (regions [addr, nbytes, dev, mem], mem
  "DRAM" or "VRAM") -> regions (how many the session holds). ``nixl_get``: keys, targets
  ([addr, nbytes] per key, inside registered regions) -> loaded (leading chunks the agent wrote
  and verified). ``nixl_put``: keys, sources ([addr, nbytes]), parents (key or nil per key) ->
  stored. Descriptors are plain lists, never NIXL's pickled ones: the agent unpickles nothing.

Parsing never trusts the peer: anything malformed raises RemoteProtocolError (the server then
replies with an error or closes the connection); a bad call on our side raises
LocalProtocolError.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

import msgpack

from kvproto.keys import KEY_BYTES

__all__ = [
    "ADMIN_OPS",
    "ADMIN_TENANT",
    "CONTROL_FRAME_BYTES_MAX",
    "GRANT_BYTES_MAX",
    "HELLO_FRAME_BYTES_MAX",
    "KEY_BYTES",
    "LOOKUP_KEYS_MAX",
    "NEED_DATA",
    "NIXL_METADATA_BYTES_MAX",
    "NIXL_OPS",
    "NIXL_REGIONS_MAX",
    "NIXL_REGION_BYTES_MAX",
    "NIXL_SPAN_BYTES_MAX",
    "OPS",
    "PROTOCOL_VERSION",
    "REPLICAS_MAX",
    "STATS_TENANTS_PAGE_MAX",
    "TENANTS_MAX",
    "ErrorCode",
    "FrameDecoder",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Reply",
    "Request",
    "SessionState",
    "encode_frame",
    "encode_reply",
    "encode_request",
    "grant_bytes_problem",
    "next_session_state",
    "parse_reply",
    "parse_request",
    "valid_tenant_name",
]

PROTOCOL_VERSION: Final = 1
# A lookup of LOOKUP_KEYS_MAX keys answers with that many hits of ~60 bytes each: 4096 keys is a
# 1M-token prompt at 256 tokens a chunk, and its reply (~250 KiB) fits the frame limit with room.
LOOKUP_KEYS_MAX: Final = 4096
# Tenants one agent serves: each is an NVMe-oF subsystem with its own keys and tiers; far above
# any DPU's real tenant count, and it bounds every per-tenant table (tokens, keys, engine state).
# copies of one chunk (the `replicas` of a members reply); beyond this a chunk is a broadcast,
# not a cache
REPLICAS_MAX: Final = 8
TENANTS_MAX: Final = 4096
# 1 MiB bounds what one peer can make us buffer per connection; no control message needs more.
CONTROL_FRAME_BYTES_MAX: Final = 1 << 20
# Per-tenant rows in one admin `stats` reply: a row is at most ~550 bytes (two tiers, 63-byte
# name, 64-bit counters), so a page stays near half a frame; every tenant's would be 2.2 MiB
STATS_TENANTS_PAGE_MAX: Final = 1000
# Until a session's hello has succeeded its frames are at most this: a hello (version, tenant,
# token, host NQN, client name, peer proof) or a peer challenge is a few hundred bytes. A
# stranger who announces a 1 MiB frame then holds 16 KiB, not 1 MiB (256 strangers held 290 MiB).
HELLO_FRAME_BYTES_MAX: Final = 16 << 10
CHECKSUM_BYTES: Final = 16
REQUEST_ID_MAX: Final = (1 << 32) - 1
STRING_BYTES_MAX: Final = 4096  # paths, tokens, names; longer is a bug or an attack
RESTORE_DIRS_MAX: Final = 1024  # one full backup plus its incrementals
ADMIN_TENANT: Final = "_admin"
# NIXL agent metadata is ~0.3-0.5 KiB over UCX (measured); 64 KiB leaves room for many devices.
NIXL_METADATA_BYTES_MAX: Final = 64 << 10
# Regions one session registers (host_shim.transport.NIXL_REGIONS_MAX): a KV pool's tensors.
NIXL_REGIONS_MAX: Final = 4096
# One region: the host keeps at most 64 GiB registered in all (host_shim.transport
# NIXL_REGISTERED_BYTES_MAX, a GPU's whole HBM), so no single region is larger.
NIXL_REGION_BYTES_MAX: Final = 64 << 30
# One span of a get or put is one chunk: the engine's CHUNK_BYTES_MAX (1 GiB). Checked here, so a
# claimed 2^63-byte span is refused before the agent plans a single segment of it.
NIXL_SPAN_BYTES_MAX: Final = 1 << 30
NIXL_MEM_TYPES: Final = ("DRAM", "VRAM")
PEER_NONCE_BYTES: Final = 32  # peer_challenge nonces and proofs (kvproto.peer_auth)

_LENGTH = struct.Struct(">I")
_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


class ProtocolError(Exception):
    """Base of both protocol errors; `code` is the ErrorCode the peer is told."""

    def __init__(self, message: str, code: str = "protocol") -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """We were about to send something invalid: a programming error on our side."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid; tell it `code` and the message, or close."""


class ErrorCode(enum.StrEnum):
    PROTOCOL = "protocol"  # malformed frame or request
    VERSION = "version"  # hello with another protocol version
    AUTH = "auth"  # no session, wrong token or unknown tenant
    FORBIDDEN = "forbidden"  # admin op from a tenant session
    NOT_FOUND = "not_found"  # unknown key, lease or reservation
    EXPIRED = "expired"  # lease or reservation expired
    FULL = "full"  # no room even after eviction
    CHECKSUM = "checksum"  # integrity failure
    FAILED = "failed"  # the operation failed for another operating reason
    UNAVAILABLE = "unavailable"  # the agent refuses writes for now (journal); retry later
    INTERNAL = "internal"  # a bug in the agent; it keeps serving
    MOVED = "moved"  # cluster: the request's epoch is not this node's; read members again


class SessionState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    READY = "ready"
    CLOSED = "closed"


class _NeedData(enum.Enum):
    NEED_DATA = "need_data"


NEED_DATA: Final = _NeedData.NEED_DATA


def valid_tenant_name(name: str) -> bool:
    """Tenant names go into NVMe NQNs: lowercase letters, digits and '-', at most 63."""
    return bool(_TENANT_RE.fullmatch(name))


# --- field validators: each returns an error string or None -------------------------------


def _int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 63)
    return None if ok else "a non-negative integer"


def _posint(v: Any) -> str | None:
    return "a positive integer" if _int(v) or v == 0 else None


# A rebalance grant's size at most: a peer's huge grant would put the receiver's shared bucket
# in debt for days, and every other sender with it
GRANT_BYTES_MAX = 1 << 40


def grant_bytes_problem(v: Any) -> str | None:
    """Why `v` is not a `cluster_grant` size (None: it is one)."""
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 < v <= GRANT_BYTES_MAX
    return None if ok else f"a whole number in 1..{GRANT_BYTES_MAX}"


def _str(v: Any) -> str | None:
    ok = isinstance(v, str) and len(v) <= STRING_BYTES_MAX
    return None if ok else f"a string of at most {STRING_BYTES_MAX} characters"


# A token an operator chooses (a tenant's, the admin's): generated ones have 43 characters. A
# short one is guessed; whitespace inside one is lost by the files that hold it (stripped).
TOKEN_CHARS_MIN = 16


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a tenant's or the admin's token, or None."""
    if len(token) < TOKEN_CHARS_MIN:
        return f"must have at least {TOKEN_CHARS_MIN} characters (it has {len(token)})"
    if len(token.encode()) > STRING_BYTES_MAX:  # its file is read back in bytes
        return f"must have at most {STRING_BYTES_MAX} bytes in UTF-8"
    if not token.isprintable() or any(c.isspace() for c in token):
        return "must be printable characters without spaces"
    return None


def _token(v: Any) -> str | None:
    why = _str(v) or token_problem(v)
    return None if why is None else f"a token that {why}"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "a boolean"


def _key(v: Any) -> str | None:
    return None if isinstance(v, bytes) and len(v) == KEY_BYTES else f"{KEY_BYTES} bytes"


def _checksum(v: Any) -> str | None:
    ok = isinstance(v, bytes) and len(v) == CHECKSUM_BYTES
    return None if ok else f"{CHECKSUM_BYTES} bytes"


def _keys(v: Any) -> str | None:
    if not isinstance(v, list) or len(v) > LOOKUP_KEYS_MAX:
        return f"a list of at most {LOOKUP_KEYS_MAX} keys"
    # The hot path of every lookup, in C: join() refuses anything but bytes-like items (msgpack
    # decodes bin to bytes only), then every item must be KEY_BYTES long.
    try:
        b"".join(v)
    except TypeError:
        return f"a list of {KEY_BYTES}-byte keys"
    return None if set(map(len, v)) <= {KEY_BYTES} else f"a list of {KEY_BYTES}-byte keys"


def _nonce(v: Any) -> str | None:
    return None if isinstance(v, bytes) and len(v) == PEER_NONCE_BYTES else (
        f"{PEER_NONCE_BYTES} bytes")  # fmt: skip


def _tenant(v: Any) -> str | None:
    ok = isinstance(v, str) and (v == ADMIN_TENANT or valid_tenant_name(v))
    return None if ok else "a tenant name ([a-z0-9][a-z0-9-]{0,62})"


def _dirs(v: Any) -> str | None:
    if not isinstance(v, list) or not 0 < len(v) <= RESTORE_DIRS_MAX:
        return f"a list of 1 to {RESTORE_DIRS_MAX} directories"
    return next(("a list of directory strings" for d in v if _str(d)), None)


def _restore_mode(v: Any) -> str | None:
    ok = v in ("start", "resume", "rollback")
    return None if ok else "start, resume or rollback"


def _metadata(v: Any) -> str | None:
    ok = isinstance(v, bytes) and 0 < len(v) <= NIXL_METADATA_BYTES_MAX
    return None if ok else f"1 to {NIXL_METADATA_BYTES_MAX} bytes of NIXL agent metadata"


def _u64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


def _regions(v: Any) -> str | None:
    ok = isinstance(v, list) and len(v) <= NIXL_REGIONS_MAX and all(
        isinstance(r, list) and len(r) == 4 and _u64(r[0]) and _u64(r[1])
        and 0 < r[1] <= NIXL_REGION_BYTES_MAX and r[0] + r[1] <= 1 << 64
        and _u64(r[2]) and r[3] in NIXL_MEM_TYPES
        for r in v
    )  # fmt: skip
    return None if ok else (
        f"a list of at most {NIXL_REGIONS_MAX} [addr, nbytes, dev, mem], nbytes 1 to "
        f"{NIXL_REGION_BYTES_MAX}"
    )  # fmt: skip


def _spans(v: Any) -> str | None:
    ok = isinstance(v, list) and len(v) <= LOOKUP_KEYS_MAX and all(
        isinstance(r, list) and len(r) == 2 and _u64(r[0]) and _u64(r[1])
        and 0 < r[1] <= NIXL_SPAN_BYTES_MAX and r[0] + r[1] <= 1 << 64
        for r in v
    )  # fmt: skip
    return None if ok else (
        f"a list of at most {LOOKUP_KEYS_MAX} [addr, nbytes] spans, nbytes 1 to "
        f"{NIXL_SPAN_BYTES_MAX}"
    )  # fmt: skip


def _parents(v: Any) -> str | None:
    ok = (
        isinstance(v, list)
        and len(v) <= LOOKUP_KEYS_MAX
        and all(p is None or _key(p) is None for p in v)
    )
    return None if ok else f"a list of {KEY_BYTES}-byte keys or nil"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def opt(v: Any) -> str | None:
        return None if v is None else check(v)

    return opt


_Schema = dict[str, tuple[Callable[[Any], str | None], bool]]  # field -> (check, required)

OPS: Final[dict[str, _Schema]] = {
    "hello": {
        "version": (_int, True),
        "tenant": (_tenant, True),
        "token": (_str, True),
        "hostnqn": (_optional(_str), False),
        "client": (_optional(_str), False),
        "peer_proof": (_optional(_nonce), False),  # agent to agent: see peer_challenge
        "incarnation": (_optional(_str), False),  # agent to agent: the tenant's, from etcd
    },
    "peer_challenge": {"node": (_str, True), "nonce": (_nonce, True)},
    "lookup": {
        "keys": (_keys, True),
        "lease": (_optional(_bool), False),
        "epoch": (_optional(_int), False),  # cluster: the client's membership epoch
        # false: a writer's check of what is already stored, not a read (no hit/miss counted)
        "count": (_optional(_bool), False),
    },
    "release": {"lease_id": (_int, True)},
    "reserve": {
        "key": (_key, True),
        "length": (_posint, True),
        "parent": (_optional(_key), False),
        "epoch": (_optional(_int), False),
    },
    "commit": {"reservation_id": (_int, True), "checksum": (_checksum, True)},
    "abort": {"reservation_id": (_int, True)},
    "delete": {"key": (_key, True), "corrupt": (_optional(_bool), False)},
    "pin": {"key": (_key, True)},
    "unpin": {"key": (_key, True)},
    "stats": {  # the admin's: a page of the per-tenant rows (module docstring)
        "tenants_after": (_optional(_tenant), False),
        "tenants_limit": (_optional(_int), False),
    },
    "members": {"since": (_optional(_int), False)},  # cluster: the client's epoch (a delta)
    "tenants_list": {},
    "tenant_add": {
        "tenant": (_tenant, True),
        "token": (_optional(_token), False),
        "quota_bytes": (_optional(_int), False),
    },
    "tenant_remove": {"tenant": (_tenant, True)},
    "tenant_rotate": {"tenant": (_tenant, True), "token": (_optional(_token), False)},
    "host_add": {"tenant": (_tenant, True), "nqn": (_str, True)},
    "host_list": {"tenant": (_tenant, True)},
    "host_remove": {"tenant": (_tenant, True), "nqn": (_str, True)},
    "evict": {"tenant": (_tenant, True), "bytes": (_int, True)},
    "checkpoint": {},
    "backup": {"dir": (_str, True), "incremental": (_bool, True)},
    "restore": {
        "dirs": (_optional(_dirs), False),
        "mode": (_optional(_restore_mode), False),  # start (default), resume, rollback
    },
    "chunks_list": {
        "tenant": (_tenant, True),
        "limit": (_posint, True),
        "after": (_optional(_key), False),
    },
    "chunk_inspect": {"tenant": (_tenant, True), "key": (_key, True)},
    # agent to agent (dpu_agent.cluster): the receiver's rebalance rate, replica digests,
    # which copies beyond R their first owner still marks hot
    "cluster_grant": {"bytes": (grant_bytes_problem, True)},
    "cluster_hot": {"keys": (_keys, True)},
    "cluster_digest": {
        "coordinator": (_str, True),
        "epoch": (_int, True),
        "bucket": (_optional(_int), False),
    },
    "nixl_connect": {"metadata": (_metadata, True)},
    "nixl_register": {
        "metadata": (_metadata, True),
        "add": (_regions, True),
        "drop": (_regions, True),
    },
    "nixl_get": {"keys": (_keys, True), "targets": (_spans, True)},
    "nixl_put": {"keys": (_keys, True), "sources": (_spans, True), "parents": (_parents, True)},
}
# The names a request of each op may carry: its fields plus id and op (checked per request).
_NAMES: Final = {op: frozenset(schema) | {"id", "op"} for op, schema in OPS.items()}
ADMIN_OPS: Final = frozenset(
    {"tenants_list", "tenant_add", "tenant_remove", "evict", "checkpoint", "backup", "restore"}
    | {"chunks_list", "chunk_inspect", "host_add", "host_list", "host_remove", "tenant_rotate"}
)
# The NIXL data-path ops: tenant ops the agent runs off its event loop, in order per session.
NIXL_OPS: Final = frozenset({"nixl_connect", "nixl_register", "nixl_get", "nixl_put"})
# Ops an admin session may also send (stats over all tenants, members).
_ADMIN_ALSO: Final = frozenset({"stats", "members"})

# The session's state table: (state, op) -> next state; a pair missing here is refused.
_TRANSITIONS: Final[dict[tuple[SessionState, str], SessionState]] = {
    (SessionState.AWAIT_HELLO, "hello"): SessionState.READY,
    (SessionState.AWAIT_HELLO, "peer_challenge"): SessionState.AWAIT_HELLO,
    **{
        (SessionState.READY, op): SessionState.READY
        for op in OPS
        if op not in ("hello", "peer_challenge")
    },
}


def next_session_state(state: SessionState, op: str, *, admin: bool) -> SessionState:
    """The state after `op`; RemoteProtocolError when the op is not allowed now."""
    nxt = _TRANSITIONS.get((state, op))
    if nxt is None:
        if state is SessionState.AWAIT_HELLO:
            raise RemoteProtocolError(f"'{op}' before hello; send hello first", ErrorCode.AUTH)
        raise RemoteProtocolError(f"'{op}' not allowed in state {state.value}")
    if state is SessionState.READY:
        if admin and op not in ADMIN_OPS and op not in _ADMIN_ALSO:
            raise RemoteProtocolError(
                f"'{op}' needs a tenant session, not an admin one", ErrorCode.FORBIDDEN
            )
        if not admin and op in ADMIN_OPS:
            raise RemoteProtocolError(
                f"'{op}' is an admin operation; connect as {ADMIN_TENANT} with the admin token",
                ErrorCode.FORBIDDEN,
            )
    return nxt


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    id: int
    op: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert 0 <= self.id <= REQUEST_ID_MAX, self.id
        assert self.op in OPS, self.op


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    id: int
    ok: bool
    result: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""
    message: str = ""

    def __post_init__(self) -> None:
        assert 0 <= self.id <= REQUEST_ID_MAX, self.id
        assert self.ok or self.error, "an error reply needs a code"


# --- encoding -------------------------------------------------------------------------------


def encode_frame(msg: Mapping[str, Any]) -> bytes:
    """One frame for `msg`; LocalProtocolError when it is over CONTROL_FRAME_BYTES_MAX."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > CONTROL_FRAME_BYTES_MAX:
        raise LocalProtocolError(
            f"frame of {len(body)} bytes over CONTROL_FRAME_BYTES_MAX={CONTROL_FRAME_BYTES_MAX}; "
            "split the request"
        )
    return _LENGTH.pack(len(body)) + body


def encode_request(req_id: int, op: str, **fields: Any) -> bytes:
    """A request frame; fields are validated as the server will (LocalProtocolError)."""
    msg = {"id": req_id, "op": op}
    msg.update((k, v) for k, v in fields.items() if v is not None)
    try:
        _check_request(msg)
    except RemoteProtocolError as e:
        raise LocalProtocolError(str(e), e.code) from None
    return encode_frame(msg)


def encode_reply(reply: Reply) -> bytes:
    if reply.ok:
        result = reply.result if type(reply.result) is dict else dict(reply.result)
        return encode_frame({"id": reply.id, "ok": True, "result": result})
    msg = {"id": reply.id, "ok": False, "error": reply.error, "message": reply.message}
    return encode_frame(msg)


# --- decoding -------------------------------------------------------------------------------


def _request_id(msg: Mapping[str, Any]) -> int:
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= REQUEST_ID_MAX:
        raise RemoteProtocolError(f"request id must be a u32, got {rid!r:.40}")
    return rid


def parse_request(msg: Any) -> Request:
    """Validate a decoded message as a request (RemoteProtocolError with the reason)."""
    rid, op = _check_request(msg)
    fields = msg.copy()
    del fields["id"], fields["op"]
    return Request(id=rid, op=op, fields=fields)


def _check_request(msg: Any) -> tuple[int, str]:
    """The request's id and op once every field passed its check (RemoteProtocolError)."""
    if not isinstance(msg, dict):
        raise RemoteProtocolError(f"a request is a map, got {type(msg).__name__}")
    rid = _request_id(msg)
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise RemoteProtocolError(f"unknown op {op!r:.40}; known: {', '.join(sorted(OPS))}")
    schema = OPS[op]
    if not msg.keys() <= _NAMES[op]:
        extra = set(msg) - _NAMES[op]
        raise RemoteProtocolError(f"{op}: unknown fields {sorted(map(str, extra))}")
    for name, (check, required) in schema.items():
        if name not in msg:
            if required:
                raise RemoteProtocolError(f"{op}: missing field '{name}'")
            continue
        problem = check(msg[name])
        if problem:
            raise RemoteProtocolError(f"{op}: field '{name}' must be {problem}")
    return rid, op


def parse_reply(msg: Any) -> Reply:
    """Validate a decoded message as a reply (RemoteProtocolError with the reason)."""
    if not isinstance(msg, dict):
        raise RemoteProtocolError(f"a reply is a map, got {type(msg).__name__}")
    rid = _request_id(msg)
    ok = msg.get("ok")
    if ok is True:
        result = msg.get("result")
        if not isinstance(result, dict):
            raise RemoteProtocolError("reply: 'result' must be a map")
        return Reply(id=rid, ok=True, result=result)
    if ok is False:
        error, message = msg.get("error"), msg.get("message")
        if not isinstance(error, str) or not error or not isinstance(message, str):
            raise RemoteProtocolError("error reply: 'error' and 'message' must be strings")
        return Reply(id=rid, ok=False, error=error, message=message)
    raise RemoteProtocolError(f"reply: 'ok' must be a boolean, got {ok!r:.40}")


class FrameDecoder:
    """Bytes in, decoded msgpack maps out; no I/O. After an error every call raises again.

    ``dec.receive_data(buf); while (msg := dec.next_message()) is not NEED_DATA: ...``
    """

    def __init__(self, frame_bytes_max: int = CONTROL_FRAME_BYTES_MAX) -> None:
        assert 0 < frame_bytes_max <= CONTROL_FRAME_BYTES_MAX, frame_bytes_max
        self._buf = bytearray()
        self._error: RemoteProtocolError | None = None
        # the largest frame accepted now (a server raises it from HELLO_FRAME_BYTES_MAX)
        self.frame_bytes_max = frame_bytes_max

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        self._buf += data
        # One frame plus its header is the most a well-behaved peer leaves unread.
        if len(self._buf) > 2 * (self.frame_bytes_max + _LENGTH.size):
            self._fail("peer sent more than two frames ahead without reading replies")

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def _fail(self, message: str) -> NoReturn:
        self._error = RemoteProtocolError(message)
        self._buf.clear()
        raise self._error

    def next_message(self) -> dict[str, Any] | _NeedData:
        if self._error is not None:
            raise self._error
        if len(self._buf) < _LENGTH.size:
            return NEED_DATA
        (length,) = _LENGTH.unpack_from(self._buf)
        if length > self.frame_bytes_max:
            if self.frame_bytes_max < CONTROL_FRAME_BYTES_MAX:
                self._fail(f"frame of {length} bytes before hello (at most "
                           f"HELLO_FRAME_BYTES_MAX={self.frame_bytes_max})")  # fmt: skip
            self._fail(f"frame of {length} bytes over CONTROL_FRAME_BYTES_MAX")
        if length == 0:
            self._fail("empty frame")
        end = _LENGTH.size + length
        if len(self._buf) < end:
            return NEED_DATA
        body = self._buf[_LENGTH.size : end]  # a copy (bytearray): the buffer moves on
        del self._buf[:end]
        try:
            msg = _unpack_one(body)
        except RemoteProtocolError as e:
            self._fail(str(e))
        if not isinstance(msg, dict):
            self._fail(f"frame body must be a msgpack map, got {type(msg).__name__}")
        return msg


def _unpack_one(body: bytes | bytearray) -> Any:
    """One msgpack object filling `body` exactly (which is at most CONTROL_FRAME_BYTES_MAX)."""
    try:
        return msgpack.unpackb(body, **_UNPACK_LIMITS)
    except msgpack.ExtraData:
        raise RemoteProtocolError(
            f"trailing bytes after the msgpack map ({len(body)}-byte frame)"
        ) from None
    except Exception as e:  # msgpack raises many types (ValueError, StackError, ...)
        raise RemoteProtocolError(f"bad msgpack in frame: {type(e).__name__}: {e}"[:200]) from None


# Options of every unpack, passed explicitly (the body is already bounded by the frame limit).
_UNPACK_LIMITS: Final[dict[str, Any]] = {
    "raw": False,
    "use_list": True,
    "strict_map_key": True,
    "max_str_len": CONTROL_FRAME_BYTES_MAX,
    "max_bin_len": CONTROL_FRAME_BYTES_MAX,
    "max_array_len": LOOKUP_KEYS_MAX + 16,
    # a map per tenant in `stats` and `tenants` replies: 1024 refused the admin's reply on an
    # agent of more tenants (found by an attack pass), though TENANTS_MAX may exist
    "max_map_len": TENANTS_MAX + 64,
    "max_ext_len": 0,
}
