"""Request dispatch: session state, authentication, tenant scoping, engine calls, error replies.

Every engine call passes the session's authenticated tenant, never a tenant named in the
request; leases and reservations are remembered per session, so one tenant cannot release or
commit another's even by guessing ids. Operating errors become error replies with a code and a
message saying what to do; any other exception is a bug: an `internal` reply and a logged
traceback, except an AssertionError (a broken invariant), which is never served past: it goes
to the server's `fatal` hook (the agent exits; the journal has every acknowledged commit).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dpu_agent import telemetry
from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.cluster._peer import PeerAuth, refuse
from dpu_agent.control import _metrics as m
from dpu_agent.control._auth import TenantRegistry
from dpu_agent.engine import errors as engine_errors
from dpu_agent.log import RateLimitedLog, get_logger
from kvproto.control import (
    ADMIN_TENANT,
    NIXL_OPS,
    PROTOCOL_VERSION,
    ErrorCode,
    RemoteProtocolError,
    Reply,
    Request,
    SessionState,
    next_session_state,
    parse_request,
)
from kvproto.peer_auth import NONCE_BYTES, server_proof, verify_proof

__all__ = ["ControlBackend", "Dispatcher", "Session"]

log = get_logger("dpu_agent.control")
refusals = RateLimitedLog(log)  # failed logins: a flood costs a few lines a second

# Outstanding leases / reservations one session may hold: a client pipelining a 1M-token
# prompt holds 4096; 64 Ki leaves room for many such while bounding memory per connection.
SESSION_LEASES_MAX = 1 << 16
SESSION_RESERVATIONS_MAX = 1 << 16
HELLO_FAILURES_MAX = 3  # then the connection is closed: no token guessing on one connection

_ERROR_CODES: tuple[tuple[type[Exception], ErrorCode], ...] = (
    (engine_errors.JournalUnavailable, ErrorCode.UNAVAILABLE),  # `full` when the disk is full
    (engine_errors.TierFull, ErrorCode.FULL),
    (engine_errors.QuotaExceeded, ErrorCode.FULL),
    (engine_errors.UnknownKey, ErrorCode.NOT_FOUND),
    (engine_errors.LeaseExpired, ErrorCode.EXPIRED),
    (engine_errors.ReservationExpired, ErrorCode.EXPIRED),
    (engine_errors.ChecksumMismatch, ErrorCode.CHECKSUM),
    (engine_errors.UnknownTenant, ErrorCode.AUTH),
    (engine_errors.EngineError, ErrorCode.FAILED),
    (BlockDeviceError, ErrorCode.FAILED),
    (OSError, ErrorCode.FAILED),
    (LookupError, ErrorCode.NOT_FOUND),  # admin ops: unknown tenant
    (ValueError, ErrorCode.FAILED),  # admin ops: tenant exists, bad backup directory
)


class ControlBackend(Protocol):
    """What the dispatcher needs from the agent (dpu_agent.service.Agent implements it)."""

    engine: Any
    lease_ttl_s: float

    def hello_info(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        """`local_host`: the agent address the client reached (for wildcard NVMe/TCP binds)."""
        ...

    def bind_host(self, session: Session, hostnqn: str) -> None:
        """Allow `hostnqn` on the session's tenant's subsystem for as long as the session
        lives, from the session's peer address only (raises an EngineError to refuse)."""
        ...

    def session_closed(self, session: Session) -> None:
        """The session ended: what bind_host allowed for it goes."""
        ...

    def members(self) -> list[dict[str, Any]]: ...

    def cluster_view(self, tenant: str) -> dict[str, Any]:
        """Cluster mode: epoch and replicas for `members`; {} for a single node."""
        ...

    def cluster_epoch(self) -> int | None:
        """The membership epoch requests are checked against; None: not in a cluster."""
        ...

    def tenants_list(self) -> list[dict[str, Any]]: ...

    async def admin(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(slots=True, kw_only=True)
class Session:
    peer: str
    session_id: int
    local_host: str = "127.0.0.1"  # the agent address this client connected to
    peer_host: str = ""  # the client's IP address ("" on the Unix socket)
    state: SessionState = SessionState.AWAIT_HELLO
    tenant: str = ""
    tenant_epoch: int = 0  # the tenant's incarnation at hello (TenantRegistry.epoch)
    hostnqn: str = ""  # the host NQN bound to this session (bind_host)
    admin: bool = False
    hello_failures: int = 0
    # agent to agent: (the peer's node, its nonce, ours) after peer_challenge; the peer's
    # node once its hello proved the cluster key
    peer_challenge: tuple[str, bytes, bytes] | None = None
    peer_node: str = ""
    leases: dict[int, float] = field(default_factory=dict)  # lease_id -> expiry (monotonic)
    reservations: dict[int, tuple[float, int]] = field(default_factory=dict)  # -> expiry, bytes

    @property
    def closing(self) -> bool:
        return self.state is SessionState.CLOSED


def plain(value: Any) -> Any:
    """Engine results (dataclasses, tuples, numpy scalars) as msgpack-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, str | bytes | bool | int | float) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalar
        return value.item()
    return str(value)


def _prune(table: dict[int, Any], limit: int, what: str) -> None:
    """Forget expired entries; refuse when the session still holds `limit` of them."""
    if len(table) < limit:
        return
    now = time.monotonic()
    for k in [k for k, v in table.items() if (v[0] if isinstance(v, tuple) else v) < now]:
        del table[k]
    if len(table) >= limit:
        raise engine_errors.LimitExceeded(
            f"session holds {limit} {what}; release or commit some before asking for more"
        )


class Dispatcher:
    """Turns one parsed message of one session into one Reply."""

    def __init__(self, backend: ControlBackend, registry: TenantRegistry) -> None:
        self.backend = backend
        self.registry = registry
        self._session_ids = itertools.count(1)
        self._sync: dict[str, Callable[[Session, Mapping[str, Any]], dict[str, Any]]] = {
            "lookup": self._lookup,
            "release": self._release,
            "reserve": self._reserve,
            "commit": self._commit,
            "abort": self._abort,
            "delete": self._delete,
            "pin": self._pin,
            "unpin": self._unpin,
            "stats": self._stats,
            "members": self._members,
            "tenants_list": self._tenants_list,
        }

    def new_session(self, peer: str, local_host: str = "127.0.0.1", peer_host: str = "") -> Session:
        return Session(peer=peer, session_id=next(self._session_ids), local_host=local_host,
                       peer_host=peer_host)  # fmt: skip

    def close_session(self, s: Session) -> None:
        """Give back what the session still holds: its leases and uncommitted reservations,
        and the host NQN it allowed on the data plane."""
        s.state = SessionState.CLOSED
        if s.hostnqn:
            self.backend.session_closed(s)
            s.hostnqn = ""
        if s.tenant and not s.admin and self.registry.epoch(s.tenant) != s.tenant_epoch:
            s.leases.clear()  # the tenant was removed: nothing of it is left to give back
            s.reservations.clear()
            return
        engine = self.backend.engine
        for lease_id in list(s.leases):
            try:
                engine.release(s.tenant, lease_id)
            except engine_errors.EngineError:
                pass  # expired or already gone: nothing to give back
        for rid in list(s.reservations):
            try:
                engine.abort(s.tenant, rid)
            except engine_errors.EngineError:
                pass
        s.leases.clear()
        s.reservations.clear()
        nixl_closed = getattr(self.backend, "nixl_session_closed", None)
        if nixl_closed is not None:  # the NIXL data path forgets the session's regions
            nixl_closed(s.session_id)

    def handle(self, s: Session, msg: Mapping[str, Any]) -> Reply | Coroutine[Any, Any, Reply]:
        """The reply now, or for admin ops (slow, run off the loop) a coroutine giving it."""
        rid = msg.get("id")
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
        rid = rid if 0 <= rid < (1 << 32) else 0
        op = str(msg.get("op", "?"))[:32]
        t0 = time.perf_counter()
        try:
            req = parse_request(msg)
            nxt = next_session_state(s.state, req.op, admin=s.admin)
            if req.op == "hello":
                result = self._hello(s, req.fields)
            elif req.op == "peer_challenge":
                result = self._peer_challenge(s, req.fields)
            else:
                self._check_tenant(s)
                if req.op in NIXL_OPS:  # data movement: off the loop, in order per session
                    return self._nixl(s, req, nxt, t0)
                handler = self._sync.get(req.op)
                if handler is None:
                    return self._admin(s, req, nxt, t0)
                result = handler(s, req.fields)
            s.state = nxt if not s.closing else s.state
            reply = Reply(id=req.id, ok=True, result=result)
        except RemoteProtocolError as e:
            if s.state is SessionState.AWAIT_HELLO and op != "hello":
                s.state = SessionState.CLOSED  # a request before hello: answer, then close
            reply = self._refused(s, rid, e)
        except AssertionError:
            raise  # a broken invariant: never answered as if the agent were fine
        except Exception as e:  # operating errors get their code; other bugs `internal`
            reply = self._failed(s, rid, op, e)
        if op in _KNOWN_OPS:
            elapsed = time.perf_counter() - t0
            _observe(op, "ok" if reply.ok else reply.error, elapsed)
            if op == "lookup":  # data-path latency per transport (dpu_agent.telemetry)
                (_LOOKUP_UNIX if s.peer == "unix" else _LOOKUP_TCP).observe(elapsed)
        return reply

    async def _admin(self, s: Session, req: Request, nxt: SessionState, t0: float) -> Reply:
        try:
            result = await self.backend.admin(req.op, req.fields)
            s.state = nxt if not s.closing else s.state
            reply = Reply(id=req.id, ok=True, result=result)
        except RemoteProtocolError as e:
            reply = self._refused(s, req.id, e)
        except AssertionError:
            raise
        except Exception as e:
            reply = self._failed(s, req.id, req.op, e)
        _observe(req.op, "ok" if reply.ok else reply.error, time.perf_counter() - t0)
        return reply

    async def _nixl(self, s: Session, req: Request, nxt: SessionState, t0: float) -> Reply:
        try:
            nixl = getattr(self.backend, "nixl", None)
            if nixl is None:
                raise RemoteProtocolError(f"{req.op}: this agent has no NIXL data path")
            result = await nixl(s.session_id, s.tenant, req.op, req.fields)
            s.state = nxt if not s.closing else s.state
            reply = Reply(id=req.id, ok=True, result=result)
        except RemoteProtocolError as e:
            reply = self._refused(s, req.id, e)
        except Exception as e:
            reply = self._failed(s, req.id, req.op, e)
        _observe(req.op, "ok" if reply.ok else reply.error, time.perf_counter() - t0)
        return reply

    def _check_tenant(self, s: Session) -> None:
        if not s.admin and self.registry.epoch(s.tenant) != s.tenant_epoch:
            s.state = SessionState.CLOSED  # removed (and maybe re-added): this session is over
            raise RemoteProtocolError(f"tenant {s.tenant!r} was removed", ErrorCode.AUTH)

    def _refused(self, s: Session, rid: int, e: RemoteProtocolError) -> Reply:
        if e.code == ErrorCode.PROTOCOL:
            m.PROTOCOL_ERRORS.inc()
        elif e.code in (ErrorCode.AUTH, ErrorCode.FORBIDDEN, ErrorCode.VERSION):
            m.AUTH_FAILURES.labels(str(e.code)).inc()
        return Reply(id=rid, ok=False, error=str(e.code), message=str(e))

    def _failed(self, s: Session, rid: int, op: str, e: Exception) -> Reply:
        for cls, code in _ERROR_CODES:
            if isinstance(e, cls):
                if isinstance(e, engine_errors.JournalUnavailable) and e.full:
                    code = ErrorCode.FULL
                return Reply(id=rid, ok=False, error=str(code), message=str(e) or cls.__name__)
        log.exception("control_internal_error", op=op, tenant=s.tenant, peer=s.peer)
        message = f"agent bug while handling {op}: {type(e).__name__}; see the agent log"
        return Reply(id=rid, ok=False, error=str(ErrorCode.INTERNAL), message=message)

    # --- session ---------------------------------------------------------------------------
    def _hello(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        if f["version"] != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"protocol version {f['version']} is not supported; this agent speaks "
                f"version {PROTOCOL_VERSION}: upgrade the client or the agent",
                ErrorCode.VERSION,
            )
        tenant = f["tenant"]
        if "peer_proof" in f:
            self._peer_hello(s, tenant, f)
        elif not self.registry.authenticate(tenant, f["token"]):
            s.hello_failures += 1
            if s.hello_failures >= HELLO_FAILURES_MAX:
                s.state = SessionState.CLOSED
            refusals.warning("control_auth_refused", tenant=str(tenant)[:64], peer=s.peer)
            raise RemoteProtocolError(
                f"tenant {tenant!r} is unknown or the token is wrong; check the token file "
                "(dpuctl tenants list)",
                ErrorCode.AUTH,
            )
        admin = tenant == ADMIN_TENANT
        hostnqn = f.get("hostnqn")
        if not admin and hostnqn:
            s.tenant = tenant  # bind_host needs it; the state moves only if hello succeeds
            self.backend.bind_host(s, hostnqn)
            s.hostnqn = hostnqn
        s.tenant, s.admin = tenant, admin
        s.tenant_epoch = self.registry.epoch(tenant)
        info = {} if s.admin else self.backend.hello_info(tenant, hostnqn, s.local_host)
        log.info("control_session", tenant=tenant, peer=s.peer, session=s.session_id)
        return {"version": PROTOCOL_VERSION, "session": s.session_id, "tenant": tenant, **info}

    def _peer_auth(self) -> PeerAuth:
        auth = getattr(self.backend, "peer_auth", None)
        if not isinstance(auth, PeerAuth):
            raise RemoteProtocolError("this agent is not in a cluster", ErrorCode.AUTH)
        return auth

    def _peer_challenge(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        """The first step of the peer handshake (kvproto.peer_auth): our proof of the cluster
        key, bound to the peer's nonce and ours; once per connection."""
        auth = self._peer_auth()
        if s.peer_challenge is not None:
            s.state = SessionState.CLOSED
            raise RemoteProtocolError("one peer_challenge per connection", ErrorCode.AUTH)
        client, nonce_c = str(f["node"])[:256], f["nonce"]
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        s.peer_challenge = (client, nonce_c, nonce_s)
        proof = server_proof(auth.keys[0], nonce_c, nonce_s, client, auth.node)
        return {"node": auth.node, "nonce": nonce_s, "proof": proof}

    def _peer_hello(self, s: Session, tenant: str, f: Mapping[str, Any]) -> None:
        """A hello proved with the cluster key for a tenant named: a peer acting for it."""
        auth = self._peer_auth()
        ch = s.peer_challenge
        ok = (
            ch is not None
            and not f["token"]
            and verify_proof(auth.keys, f["peer_proof"], "client", ch[1], ch[2], ch[0], auth.node)
        )
        if not ok:
            s.state = SessionState.CLOSED  # no second try on this connection
            refuse("client_proof", peer=s.peer, node=ch[0] if ch else "")
            raise RemoteProtocolError("peer proof refused: not a member of this cluster",
                                      ErrorCode.AUTH)  # fmt: skip
        assert ch is not None
        if tenant == ADMIN_TENANT or tenant not in self.registry:
            raise RemoteProtocolError(f"tenant {tenant!r} is unknown here", ErrorCode.AUTH)
        s.peer_node = ch[0]

    # --- tenant operations (always scoped to s.tenant) --------------------------------------
    def _lookup(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        keys: list[bytes] = f["keys"]
        stale = "epoch" in f and self._stale_epoch(f["epoch"])
        if not keys:
            return {"hits": [], "lease_id": 0, "lease_expires_s": 0.0}
        _prune(s.leases, SESSION_LEASES_MAX, "leases")
        probe = f.get("lease") is False  # a probe takes no lease: nothing to release after
        # hits as [key, nsid, lba, block_count, length, checksum], the reply's shape
        hits, held, expires_s = self.backend.engine.lookup_lists(s.tenant, keys, lease=not probe)
        lease_id = int(held or 0)
        if lease_id:
            s.leases[lease_id] = time.monotonic() + self.backend.lease_ttl_s
            _leased_bytes(s.tenant).inc(sum(h[4] for h in hits))
        elif hits:  # a probe's reply says what a read's lease would last, as it always has
            expires_s = self.backend.lease_ttl_s
        _count_lookup(s.tenant, len(hits), len(keys))
        if stale and not hits:  # held here anyway (a move in progress): served, not moved
            self._check_epoch(f["epoch"])
        return {"hits": hits, "lease_id": lease_id, "lease_expires_s": expires_s}

    def _release(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        lease_id = f["lease_id"]
        if s.leases.pop(lease_id, None) is None:
            raise engine_errors.UnknownKey(f"lease {lease_id} is not held by this session")
        self.backend.engine.release(s.tenant, lease_id)
        return {}

    def _stale_epoch(self, epoch: int) -> bool:
        current = self.backend.cluster_epoch()
        return current is not None and epoch != current

    def _check_epoch(self, epoch: int) -> None:
        current = self.backend.cluster_epoch()
        if current is not None and epoch != current:
            raise RemoteProtocolError(
                f"membership epoch {epoch} is not this node's {current}; read members again",
                ErrorCode.MOVED,
            )

    def _reserve(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        if "epoch" in f:
            self._check_epoch(f["epoch"])
        _prune(s.reservations, SESSION_RESERVATIONS_MAX, "reservations")
        r = self.backend.engine.reserve(s.tenant, f["key"], f["length"], parent=f.get("parent"))
        expiry = time.monotonic() + self.backend.lease_ttl_s
        s.reservations[int(r.reservation_id)] = (expiry, int(f["length"]))
        return {
            "reservation_id": int(r.reservation_id),
            "nsid": int(r.nsid),
            "lba": int(r.lba),
            "block_count": int(r.block_count),
            "expires_s": float(r.expires_s),
        }

    def _commit(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        rid = f["reservation_id"]
        held = s.reservations.pop(rid, None)
        if held is None:
            raise engine_errors.UnknownKey(
                f"reservation {rid} is not held by this session; reserve again"
            )
        self.backend.engine.commit(s.tenant, rid, f["checksum"])
        m.COMMITTED_BYTES.labels(s.tenant).inc(held[1])
        return {}

    def _abort(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        rid = f["reservation_id"]
        if s.reservations.pop(rid, None) is None:
            raise engine_errors.UnknownKey(f"reservation {rid} is not held by this session")
        self.backend.engine.abort(s.tenant, rid)
        return {}

    def _delete(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        if f.get("corrupt"):  # the client's checksum failed: quarantine, never reuse the extent
            m.INTEGRITY_REPORTS.labels(s.tenant).inc()
            log.warning("control_integrity_failure", tenant=s.tenant, key=f["key"].hex())
            if not self.backend.engine.report_corrupt(s.tenant, f["key"]):
                raise engine_errors.UnknownKey(f"no chunk {f['key'].hex()} to report")
            return {}
        self.backend.engine.delete(s.tenant, f["key"])
        return {}

    def _pin(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        self.backend.engine.pin(s.tenant, f["key"])
        return {}

    def _unpin(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        self.backend.engine.unpin(s.tenant, f["key"])
        return {}

    def _stats(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        stats = self.backend.engine.stats(None if s.admin else s.tenant)
        return {"stats": plain(stats)}

    def _members(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        return {"members": plain(self.backend.members()), **self.backend.cluster_view(s.tenant)}

    def _tenants_list(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        return {"tenants": plain(self.backend.tenants_list())}


_KNOWN_OPS = frozenset(
    {"hello", "peer_challenge", "lookup", "release", "reserve", "commit", "abort", "delete"}
    | {"pin", "unpin"}
    | {"stats"}
    | {"members", "tenants_list", "tenant_add", "tenant_remove", "evict", "checkpoint"}
    | {"backup", "restore"}
    | {"host_add", "host_list", "host_remove"}
    | NIXL_OPS
)


_children: dict[tuple[str, str], tuple[Any, Any]] = {}  # (op, code) -> metric children
_LOOKUP_TCP = telemetry.child("lookup", "control-tcp")
_LOOKUP_UNIX = telemetry.child("lookup", "control-unix")


def _observe(op: str, code: str, seconds: float) -> None:
    """Count and time one request; label children are cached (labels() costs microseconds)."""
    pair = _children.get((op, code))
    if pair is None:  # bounded: _KNOWN_OPS x ErrorCode
        pair = _children[(op, code)] = (m.REQUESTS.labels(op, code), m.REQUEST_SECONDS.labels(op))
    pair[0].inc()
    pair[1].observe(seconds)


_leased: dict[str, Any] = {}  # tenant -> LEASED_BYTES child


def _leased_bytes(tenant: str) -> Any:
    child = _leased.get(tenant)
    if child is None:  # bounded by the tenant count
        child = _leased[tenant] = m.LEASED_BYTES.labels(tenant)
    return child


_lookup_totals: dict[str, list[int]] = {}  # tenant -> [hits, asked]


def _count_lookup(tenant: str, hit_count: int, key_count: int) -> None:
    totals = _lookup_totals.get(tenant)
    if totals is None:  # bounded by the tenant count; the gauge reads the totals when scraped
        totals = _lookup_totals[tenant] = [0, 0]
        m.HIT_RATIO.labels(tenant).set_function(lambda: totals[0] / totals[1] if totals[1] else 0)
    totals[0] += hit_count
    totals[1] += key_count
