"""What the Serf RPC codec hands back: replies and the records of streams, monitors and queries.

Frozen, slotted, keyword-only dataclasses that validate when built from the agent's maps
(`from_wire`), so a malformed map is a RemoteProtocolError at the boundary, not a KeyError later.
Field names follow Serf's Go structs (client/const.go) in snake case.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvproto.serf._errors import RemoteProtocolError

__all__ = [
    "MEMBER_STATUSES",
    "LogRecord",
    "Member",
    "MemberEvent",
    "QueryEvent",
    "QueryRecord",
    "Reply",
    "StreamRecord",
    "UserEvent",
]

# serf.MemberStatus.String(): "none" is a member Serf knows nothing about yet
MEMBER_STATUSES = frozenset({"none", "alive", "leaving", "left", "failed"})
MEMBER_EVENTS = frozenset(
    {"member-join", "member-leave", "member-failed", "member-update", "member-reap"}
)
QUERY_RECORD_TYPES = frozenset({"ack", "response", "done"})


def _get(m: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = m.get(name)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise RemoteProtocolError(f"{what}: field {name!r} is {v!r:.60}, not {kind}")
    return v


def _payload(m: Mapping[str, Any], what: str) -> bytes:
    v = m.get("Payload")
    if v is None:  # Go's nil []byte
        return b""
    if not isinstance(v, bytes | str):
        raise RemoteProtocolError(f"{what}: Payload is {type(v).__name__}, not bytes")
    return v.encode() if isinstance(v, str) else v


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    name: str
    addr: str  # the gossip address, as text
    port: int
    tags: Mapping[str, str]
    status: str  # one of MEMBER_STATUSES
    protocol_cur: int = 0
    delegate_cur: int = 0

    def __post_init__(self) -> None:
        assert self.status in MEMBER_STATUSES, self.status
        assert 0 <= self.port < 65536, self.port

    @classmethod
    def from_wire(cls, m: Any) -> Member:
        if not isinstance(m, dict):
            raise RemoteProtocolError(f"a member is a map, got {type(m).__name__}")
        name = _get(m, "Name", str, "member")
        raw = _get(m, "Addr", (bytes, str), f"member {name}")
        try:
            addr = str(ipaddress.ip_address(raw)) if isinstance(raw, bytes) else raw
        except ValueError:
            raise RemoteProtocolError(f"member {name}: Addr of {len(raw)} bytes") from None
        port = _get(m, "Port", int, f"member {name}")
        status = _get(m, "Status", str, f"member {name}")
        tags = m.get("Tags") or {}
        ok = isinstance(tags, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in tags.items()
        )
        if not ok or status not in MEMBER_STATUSES or not 0 <= port < 65536:
            raise RemoteProtocolError(f"member {name}: bad Tags, Status {status!r} or Port")
        return cls(
            name=name, addr=addr, port=port, tags=dict(tags), status=status,
            protocol_cur=int(m.get("ProtocolCur") or 0),
            delegate_cur=int(m.get("DelegateCur") or 0),
        )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """The answer to one command; `error` is "" on success. `body` is the map that followed
    the header (members, join), None for header-only replies."""

    seq: int
    command: str
    error: str
    body: Mapping[str, Any] | None = None
    members: tuple[Member, ...] = ()  # members / members-filtered replies, validated


def members_of(command: str, body: Mapping[str, Any]) -> tuple[Member, ...]:
    raw = body.get("Members")
    if not isinstance(raw, list):
        raise RemoteProtocolError(f"{command} reply: Members is not a list")
    return tuple(Member.from_wire(m) for m in raw)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberEvent:
    seq: int
    event: str  # one of MEMBER_EVENTS
    members: tuple[Member, ...] = field(default=())


@dataclass(frozen=True, slots=True, kw_only=True)
class UserEvent:
    seq: int
    ltime: int
    name: str
    payload: bytes
    coalesce: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryEvent:
    """A query some node sent, delivered to this stream; answer it with `respond`."""

    seq: int
    id: int
    ltime: int
    name: str
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryRecord:
    """One record of a query we sent: an ack, a response, or done (no more records)."""

    seq: int
    type: str  # one of QUERY_RECORD_TYPES
    from_: str
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LogRecord:
    seq: int
    log: str


StreamRecord = MemberEvent | UserEvent | QueryEvent | QueryRecord | LogRecord


def stream_record(seq: int, rec: Any) -> MemberEvent | UserEvent | QueryEvent:
    """A record of an event stream (`stream` command), validated."""
    if not isinstance(rec, dict):
        raise RemoteProtocolError(f"stream record is {type(rec).__name__}, not a map")
    event = rec.get("Event")
    if event in MEMBER_EVENTS:
        raw = rec.get("Members")
        if not isinstance(raw, list):
            raise RemoteProtocolError(f"{event} record without a Members list")
        return MemberEvent(seq=seq, event=event, members=tuple(Member.from_wire(m) for m in raw))
    if event == "user":
        return UserEvent(
            seq=seq, ltime=_get(rec, "LTime", int, "user event"),
            name=_get(rec, "Name", str, "user event"), payload=_payload(rec, "user event"),
            coalesce=bool(rec.get("Coalesce")),
        )  # fmt: skip
    if event == "query":
        return QueryEvent(
            seq=seq, id=_get(rec, "ID", int, "query event"),
            ltime=_get(rec, "LTime", int, "query event"),
            name=_get(rec, "Name", str, "query event"), payload=_payload(rec, "query event"),
        )  # fmt: skip
    raise RemoteProtocolError(f"stream record with unknown Event {event!r:.40}")


def query_record(seq: int, rec: Any) -> QueryRecord:
    if not isinstance(rec, dict):
        raise RemoteProtocolError(f"query record is {type(rec).__name__}, not a map")
    kind = rec.get("Type")
    if kind not in QUERY_RECORD_TYPES:
        raise RemoteProtocolError(f"query record with unknown Type {kind!r:.40}")
    from_ = rec.get("From") or ""
    if not isinstance(from_, str):
        raise RemoteProtocolError("query record: From is not a string")
    return QueryRecord(seq=seq, type=kind, from_=from_, payload=_payload(rec, "query record"))


def log_record(seq: int, rec: Any) -> LogRecord:
    if not isinstance(rec, dict) or not isinstance(rec.get("Log"), str):
        raise RemoteProtocolError("monitor record without a Log string")
    return LogRecord(seq=seq, log=rec["Log"])
