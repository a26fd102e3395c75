"""Request dispatch: session state, authentication, tenant scoping, engine calls, error replies.

Every engine call passes the session's authenticated tenant, never a tenant named in the
request; leases and reservations are remembered per session, so one tenant cannot release or
commit another's even by guessing ids. Operating errors become error replies with a code and a
message saying what to do; any other exception is a bug: an `internal` reply and a logged
traceback, except an AssertionError (a broken invariant), which is never served past: it goes
to the server's `fatal` hook (the agent exits; the journal has every acknowledged commit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
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
from dpu_agent.engine import Engine
from dpu_agent.engine import errors as engine_errors
from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.metrics import on_forget_tenant
from kvproto.control import (
    ADMIN_TENANT,
    NIXL_OPS,
    PROTOCOL_VERSION,
    STATS_TENANTS_PAGE_MAX,
    ErrorCode,
    RemoteProtocolError,
    Reply,
    Request,
    SessionState,
    next_session_state,
    parse_request,
)
from kvproto.nvme import NQN_BYTES_MAX
from kvproto.peer_auth import NONCE_BYTES, server_proof, verify_proof

__all__ = ["ControlBackend", "Dispatcher", "Session", "host_nqn_problem"]

log = get_logger("dpu_agent.control")
refusals = RateLimitedLog(log)  # failed logins: a flood costs a few lines a second

# Outstanding leases / reservations one session may hold: a client pipelining a 1M-token
# prompt holds 4096; 64 Ki leaves room for many such while bounding memory per connection.
# What `members` tells the operator (dpuctl status) and not a tenant: the admin socket's path,
# the process, how many tenants share the agent, an interrupted restore's backup directories.
# (capacity_bytes stays: a cluster client's placement weighs members by it.)
# `members` fields a tenant's session does not get: how the operator runs the agent, and the
# metrics URL (unauthenticated, every tenant's live figures: found handed to every tenant)
OPERATOR_MEMBER_FIELDS = frozenset(
    {"control_unix", "pid", "uptime_s", "tenants", "restore", "metrics"}
)
SESSION_LEASES_MAX = 1 << 16
SESSION_RESERVATIONS_MAX = 1 << 16
# A closed session giving back more leases and reservations than this does it off the loop
GIVE_BACK_ON_LOOP_MAX = 64
HELLO_FAILURES_MAX = 3  # then the connection is closed: no token guessing on one connection
# Failed hellos one address may make: a burst of this many, refilled at this many per second.
# A client with a wrong token fails once and stops (a fleet restarting with a stale token file
# makes a few each); 10/s caps a guesser at ~1/250 of what it reached before (2,467/s), and
# the address is not blocked: it gets back one try per 100 ms.
HELLO_FAILURES_PER_ADDRESS_MAX = 10
# Addresses whose failures are remembered at once: a guesser spread over more addresses than
# this forgets the oldest; 4096 x ~200 bytes is under 1 MiB.
HELLO_FAILURE_ADDRESSES_MAX = 4096

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

    lease_ttl_s: float

    @property
    def engine(self) -> Engine:
        """The agent's engine (every tenant op goes to it)."""
        ...

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

    def cluster_cut_off(self) -> bool:
        """Cluster mode: this node reaches no majority of the members (it refuses writes)."""
        ...

    def cluster_members_since(self, tenant: str, since: int) -> dict[str, Any] | None:
        """`members` with `since`: unchanged or the rows changed since that epoch; None:
        send the whole list (not in a cluster, or that epoch is not remembered)."""
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


def host_nqn_problem(nqn: str) -> str | None:
    """What is wrong with a host NQN from a client or an operator (None: nothing). It goes into
    the allowlist, the host key file and NVMe Connect data, so printable ASCII only."""
    if (
        not nqn.startswith("nqn.")
        or len(nqn.encode()) > NQN_BYTES_MAX
        or not (nqn.isascii() and nqn.isprintable())
        or " " in nqn
    ):
        return (
            f"host NQN {nqn[:64]!r}: must start with 'nqn.', be printable ASCII without "
            f"spaces, <= {NQN_BYTES_MAX} bytes"
        )
    return None


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


def _principal(address: str) -> str:
    """Whose failures an address's count: IPv4 by address, IPv6 by its /64 (one host is given
    a whole /64 and picks addresses in it at will)."""
    if ":" not in address:
        return address
    try:
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    except ValueError:
        return address


class HelloFailures:
    """Failed hellos per address and tenant: a token bucket of HELLO_FAILURES_PER_ADDRESS_MAX,
    refilled at that many per second. A hello whose bucket is empty is refused unchecked. The
    tenant is part of the key (found by an attack pass: wrong-token hellos from one address
    locked every tenant's clients at that address out, 0 of 67 connects in 15 s), so guessing
    one tenant's token slows only that tenant's hellos from there; the names no tenant has
    share one bucket per address (cycling made-up names buys no fresh buckets)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def _tokens(self, address: str) -> float:
        got = self._buckets.get(address)
        if got is None:
            return float(HELLO_FAILURES_PER_ADDRESS_MAX)
        tokens, at = got
        refill = (self._clock() - at) * HELLO_FAILURES_PER_ADDRESS_MAX
        return min(float(HELLO_FAILURES_PER_ADDRESS_MAX), tokens + refill)

    def blocked(self, address: str, tenant: str = "") -> bool:
        """`tenant`: a tenant the agent has ("" for any other name)."""
        return bool(address) and self._tokens(f"{_principal(address)} {tenant}") < 1.0

    def failed(self, address: str, tenant: str = "") -> None:
        if not address:  # the Unix socket: the agent's own user
            return
        address = f"{_principal(address)} {tenant}"
        tokens = self._tokens(address) - 1.0
        self._buckets.pop(address, None)  # re-inserted last: the dict is oldest-first
        self._buckets[address] = (tokens, self._clock())
        while len(self._buckets) > HELLO_FAILURE_ADDRESSES_MAX:
            del self._buckets[next(iter(self._buckets))]


class Dispatcher:
    """Turns one parsed message of one session into one Reply."""

    def __init__(self, backend: ControlBackend, registry: TenantRegistry) -> None:
        self.backend = backend
        self.registry = registry
        self.hello_failures = HelloFailures()
        # The server's check that an authenticated session may have a connection slot (per
        # tenant, per address, global); returns why not, or None.
        self.admission: Callable[[Session, str], str | None] | None = None
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
            "cluster_grant": lambda s, f: self._cluster(s, "cluster_grant", f),
            "cluster_digest": lambda s, f: self._cluster(s, "cluster_digest", f),
            "cluster_hot": lambda s, f: self._cluster(s, "cluster_hot", f),
        }

    def new_session(self, peer: str, local_host: str = "127.0.0.1", peer_host: str = "") -> Session:
        # random: sequential ids let a tenant count the other tenants' sessions
        return Session(peer=peer, session_id=secrets.randbits(62) or 1, local_host=local_host,
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
        leases, reservations = list(s.leases), list(s.reservations)
        s.leases.clear()
        s.reservations.clear()
        if len(leases) + len(reservations) > GIVE_BACK_ON_LOOP_MAX:
            # a session holding many (each lease up to 4,096 extents to undo) is given back
            # off the event loop: on it, 472 such leases stalled every tenant 1.9 s (attack)
            asyncio.get_running_loop().run_in_executor(
                None, self._give_back, s.tenant, leases, reservations
            )
        else:
            self._give_back(s.tenant, leases, reservations)
        nixl_closed = getattr(self.backend, "nixl_session_closed", None)
        if nixl_closed is not None:  # the NIXL data path forgets the session's regions
            nixl_closed(s.session_id)

    def _give_back(self, tenant: str, leases: list[int], reservations: list[int]) -> None:
        """Release a closed session's leases and abort its reservations (the engine's lock
        makes this safe from a worker thread)."""
        engine = self.backend.engine
        for lease_id in leases:
            try:
                engine.release(tenant, lease_id)
            except engine_errors.EngineError:
                pass  # expired or already gone: nothing to give back
        for rid in reservations:
            try:
                engine.abort(tenant, rid)
            except engine_errors.EngineError:
                pass

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
            result = await nixl(s.session_id, s.tenant, req.op, req.fields, s.peer_host)
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
        bucket = tenant if tenant in self.registry else ""  # made-up names share one
        if self.hello_failures.blocked(s.peer_host, bucket):
            s.state = SessionState.CLOSED
            raise RemoteProtocolError(
                f"too many failed hellos for {tenant!r} from {s.peer_host} "
                f"(HELLO_FAILURES_PER_ADDRESS_MAX {HELLO_FAILURES_PER_ADDRESS_MAX}/s); check the "
                "token file and retry in a second",
                ErrorCode.AUTH,
            )
        if "peer_proof" in f:
            self._peer_hello(s, tenant, f)
        elif not self.registry.authenticate(tenant, f["token"]):
            self.hello_failures.failed(s.peer_host, bucket)
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
        if hostnqn and (problem := host_nqn_problem(hostnqn)):
            raise RemoteProtocolError(problem, ErrorCode.PROTOCOL)
        if self.admission is not None and (full := self.admission(s, tenant)):
            s.state = SessionState.CLOSED  # answered, then closed: its slot is someone else's
            raise RemoteProtocolError(full, ErrorCode.FAILED)
        if not admin and hostnqn:
            s.tenant = tenant  # bind_host needs it; the state moves only if hello succeeds
            self.backend.bind_host(s, hostnqn)
            s.hostnqn = hostnqn
        s.tenant, s.admin = tenant, admin
        s.tenant_epoch = self.registry.epoch(tenant)
        try:
            info = {} if s.admin else self.backend.hello_info(tenant, hostnqn, s.local_host)
        except Exception:  # refused (the host key budget): what bind_host allowed goes
            if s.hostnqn:
                self.backend.session_closed(s)
            s.hostnqn, s.tenant, s.admin, s.tenant_epoch = "", "", False, 0
            raise
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
        ours, theirs = auth.incarnation(tenant), f.get("incarnation")
        if ours is not None and theirs != ours:
            # found by an attack pass: a node cut off from etcd while the tenant was removed
            # and added again pushed the removed tenant's chunks into the new one
            refuse("tenant_incarnation", peer=s.peer, node=ch[0], tenant=tenant)
            raise RemoteProtocolError(
                f"tenant {tenant!r} here is another incarnation than the peer's (removed and "
                "added again while one of the two was cut off from etcd): nothing is exchanged",
                ErrorCode.AUTH,
            )
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
        count = f.get("count") is not False  # a put's own check is not a read: not a miss
        hits, held, expires_s = self.backend.engine.lookup_lists(
            s.tenant, keys, lease=not probe, count=count
        )
        lease_id = int(held or 0)
        if lease_id:
            s.leases[lease_id] = time.monotonic() + self.backend.lease_ttl_s
            _leased_bytes(s.tenant).inc(sum(h[4] for h in hits))
        elif hits:  # a probe's reply says what a read's lease would last, as it always has
            expires_s = self.backend.lease_ttl_s
        if count:
            _count_lookup(s.tenant, len(hits), len(keys))
        if stale and not hits:  # held here anyway (a move in progress): served, not moved
            self._check_epoch(f["epoch"])
        reply = {"hits": hits, "lease_id": lease_id, "lease_expires_s": expires_s}
        reads = getattr(self.backend, "cluster_reads", None)
        if lease_id and reads is not None:  # a read (a probe is not): hot prefixes count here
            hot = reads(s.tenant, keys[: len(hits)])
            if hot:
                reply["hot"] = hot  # indexes of hot keys: clients spread reads over copies
        return reply

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
        if "epoch" in f:  # a cluster client: a node cut off from most members takes no writes
            self._check_epoch(f["epoch"])
            if self.backend.cluster_cut_off():
                raise RemoteProtocolError(
                    "this node reaches no majority of the cluster; writes go to the majority "
                    "side (dpuctl cluster status: reach)",
                    ErrorCode.UNAVAILABLE,
                )
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
        if not s.admin:
            return {"stats": plain(self.backend.engine.stats(s.tenant))}
        limit = f.get("tenants_limit")
        limit = STATS_TENANTS_PAGE_MAX if limit is None else min(limit, STATS_TENANTS_PAGE_MAX)
        stats = self.backend.engine.stats(after=f.get("tenants_after") or "", limit=limit)
        return {"stats": plain(stats)}

    def _members(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        if f.get("since") is not None:
            delta = self.backend.cluster_members_since(s.tenant, f["since"])
            if delta is not None:
                return plain(delta)
        members = self.backend.members()
        if not s.admin:  # a tenant needs the addresses, not how the operator runs the agent
            members = [{k: v for k, v in m.items() if k not in OPERATOR_MEMBER_FIELDS}
                       for m in members]  # fmt: skip
        return {"members": plain(members), **self.backend.cluster_view(s.tenant)}

    def _cluster(self, s: Session, op: str, f: Mapping[str, Any]) -> dict[str, Any]:
        """Agent-to-agent ops of the rebalancer (dpu_agent.cluster.agent_cluster_op): only on
        a session that proved the cluster key (a tenant's client could otherwise spend a
        receiver's rebalance rate or list its keys' digests)."""
        if not s.peer_node:
            raise RemoteProtocolError(f"{op} is for cluster members (the peer handshake)",
                                      ErrorCode.AUTH)  # fmt: skip
        cluster_op = getattr(self.backend, "cluster_op", None)
        if cluster_op is None:
            raise ValueError(f"{op}: this agent is not in a cluster")
        return dict(cluster_op(s.tenant, op, f))

    def _tenants_list(self, s: Session, f: Mapping[str, Any]) -> dict[str, Any]:
        return {"tenants": plain(self.backend.tenants_list())}


_KNOWN_OPS = frozenset(
    {"hello", "peer_challenge", "lookup", "release", "reserve", "commit", "abort", "delete"}
    | {"pin", "unpin"}
    | {"stats"}
    | {"members", "tenants_list", "tenant_add", "tenant_remove", "evict", "checkpoint"}
    | {"cluster_grant", "cluster_digest", "cluster_hot"}
    | {"backup", "restore"}
    | {"host_add", "host_list", "host_remove", "tenant_rotate"}
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


@on_forget_tenant
def _forget(tenant: str) -> None:
    _leased.pop(tenant, None)
    _lookup_totals.pop(tenant, None)


def _count_lookup(tenant: str, hit_count: int, key_count: int) -> None:
    totals = _lookup_totals.get(tenant)
    if totals is None:  # bounded by the tenant count; the gauge reads the totals when scraped
        totals = _lookup_totals[tenant] = [0, 0]
        m.HIT_RATIO.labels(tenant).set_function(lambda: totals[0] / totals[1] if totals[1] else 0)
    totals[0] += hit_count
    totals[1] += key_count
