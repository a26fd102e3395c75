"""A blocking socket loop around kvproto.serf.SerfCodec: one RPC connection to a Serf agent.

Calls are serialised by a lock; records of streams and queries that arrive while a call waits
for its reply are kept (at most RECORDS_MAX) for `next_record`. `OSError` is translated here,
at the one boundary, into SerfUnreachable.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvproto.serf import (
    IPC_VERSION,
    NEED_DATA,
    Member,
    ProtocolError,
    QueryRecord,
    Reply,
    SerfCodec,
    SerfError,
    StreamRecord,
)

__all__ = ["KEY_COMMANDS", "RECORDS_MAX", "KeyringReply", "SerfClient", "SerfUnreachable"]

# Stream records held for the caller: a 1,024-node cluster's worst burst (everyone rejoins) is
# ~1,024 member events, which Serf coalesces; past this the oldest are dropped and `dropped`
# counts them: membership is state, so a caller that lost events just re-reads `members`.
RECORDS_MAX = 4096
RECV_BYTES = 256 << 10
QUERY_RECORDS_MAX = 4096  # responses one query may bring (one per node, plus acks)


KEY_COMMANDS = ("install-key", "use-key", "remove-key", "list-keys")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyringReply:
    """Serf's keyring answer: members asked, answered and failed; per-node error messages;
    for list-keys, each key with how many members hold it."""

    error: str
    nodes: int
    responses: int
    errors: int
    messages: Mapping[str, str]
    keys: Mapping[str, int]

    @classmethod
    def of(cls, error: str, body: Mapping[str, Any]) -> KeyringReply:
        def ints(v: Any) -> int:
            return v if isinstance(v, int) and not isinstance(v, bool) else 0

        def strmap(v: Any, kind: type) -> dict[str, Any]:
            items = v.items() if isinstance(v, Mapping) else ()
            return {str(k): x for k, x in items if isinstance(x, kind)}

        return cls(
            error=error, nodes=ints(body.get("NumNodes")), responses=ints(body.get("NumResp")),
            errors=ints(body.get("NumErr")), messages=strmap(body.get("Messages"), str),
            keys=strmap(body.get("Keys"), int),
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.error, "nodes": self.nodes, "responses": self.responses,
                "errors": self.errors, "messages": dict(self.messages),
                "keys": dict(self.keys)}  # fmt: skip


class SerfUnreachable(OSError):
    """The Serf agent's RPC address cannot be reached, or the connection broke."""


class SerfClient:
    """`SerfClient("127.0.0.1:7373", auth_key="")` connects, handshakes and authenticates."""

    def __init__(self, rpc_addr: str, *, auth_key: str = "", timeout_s: float = 10.0) -> None:
        host, _, port = rpc_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Serf RPC address {rpc_addr!r} must be host:port")
        self.rpc_addr = rpc_addr
        self.timeout_s = timeout_s
        self._codec = SerfCodec()
        self._lock = threading.Lock()
        self._records: collections.deque[StreamRecord] = collections.deque()
        self.dropped = 0
        try:
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout_s)
        except OSError as e:
            raise SerfUnreachable(f"cannot connect to Serf RPC {rpc_addr}: {e}") from None
        try:
            self.call("handshake", {"Version": IPC_VERSION})
            if auth_key:
                self.call("auth", {"AuthKey": auth_key})
        except BaseException:
            self.close()
            raise

    # --- plumbing -----------------------------------------------------------------------------
    def call(self, command: str, body: Mapping[str, Any] | None = None) -> Reply:
        """Send one command and wait for its reply; SerfError when the agent says no."""
        ev = self.exchange(command, body)
        if ev.error:
            raise SerfError(command, ev.error)
        return ev

    def exchange(self, command: str, body: Mapping[str, Any] | None = None) -> Reply:
        """Send one command and return its reply, an error reply included."""
        with self._lock:
            seq, data = self._codec.send(command, body)
            self._sendall(data)
            deadline = time.monotonic() + self.timeout_s
            while True:
                ev = self._next(deadline)
                if isinstance(ev, Reply) and ev.seq == seq:
                    return ev
                self._keep(ev)

    def _sendall(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise SerfUnreachable(f"Serf RPC {self.rpc_addr} broke: {e}") from None

    def _next(self, deadline: float) -> Any:
        while (ev := self._codec.next_event()) is NEED_DATA:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from Serf RPC {self.rpc_addr}")
            try:
                self._sock.settimeout(left)
                data = self._sock.recv(RECV_BYTES)
            except TimeoutError:
                raise
            except OSError as e:
                raise SerfUnreachable(f"Serf RPC {self.rpc_addr} broke: {e}") from None
            if not data:
                raise SerfUnreachable(f"Serf agent {self.rpc_addr} closed the RPC connection")
            try:
                self._codec.receive_data(data)
            except ProtocolError as e:
                raise SerfUnreachable(f"Serf RPC {self.rpc_addr}: {e}") from None
        return ev

    def _keep(self, ev: Any) -> None:
        if isinstance(ev, Reply):  # a reply nobody waits for (cannot happen: calls serialise)
            return
        self._records.append(ev)
        if len(self._records) > RECORDS_MAX:
            self._records.popleft()
            self.dropped += 1

    def next_record(self, timeout_s: float) -> StreamRecord | None:
        """The next stream/monitor/query record, or None after `timeout_s`."""
        if self._records:
            return self._records.popleft()
        with self._lock:
            try:
                ev = self._next(time.monotonic() + timeout_s)
            except TimeoutError:
                return None
        if isinstance(ev, Reply):
            return None
        return ev

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> SerfClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- commands (Serf's names; bodies as client/const.go) ---------------------------------------
    def members(self) -> list[Member]:
        return list(self.call("members").members)

    def members_filtered(
        self, tags: Mapping[str, str] | None = None, status: str = "", name: str = ""
    ) -> list[Member]:
        body = {"Tags": dict(tags or {}), "Status": status, "Name": name}
        return list(self.call("members-filtered", body).members)

    def join(self, addrs: Sequence[str], replay: bool = False) -> int:
        reply = self.call("join", {"Existing": list(addrs), "Replay": replay})
        return int((reply.body or {}).get("Num", 0))

    def tags(self, set_tags: Mapping[str, str], delete: Sequence[str] = ()) -> None:
        self.call("tags", {"Tags": dict(set_tags), "DeleteTags": list(delete)})

    def event(self, name: str, payload: bytes, coalesce: bool = False) -> None:
        self.call("event", {"Name": name, "Payload": payload, "Coalesce": coalesce})

    def stats(self) -> Mapping[str, Any]:
        return self.call("stats").body or {}

    def encrypted(self) -> bool:
        """Whether the agent encrypts gossip (it was started with a key or keyring)."""
        serf = self.stats().get("serf") or {}
        return isinstance(serf, Mapping) and serf.get("encrypted") == "true"

    def keys(self, command: str, key: str = "") -> KeyringReply:
        """A keyring command (install-key, use-key, remove-key with `key`; list-keys): what
        every member answered. Never raises for a refusal: `error` and `messages` say it."""
        assert command in KEY_COMMANDS, command
        ev = self.exchange(command, {"Key": key} if command != "list-keys" else None)
        return KeyringReply.of(ev.error, ev.body or {})

    def force_leave(self, node: str) -> None:
        self.call("force-leave", {"Node": node})

    def leave(self) -> None:
        """Leave gracefully; the agent then shuts down."""
        self.call("leave")

    def stream(self, event_filter: str = "*") -> int:
        """Subscribe to events ("member-join,user:name,query", "*"); returns the stream's seq."""
        return self.call("stream", {"Type": event_filter}).seq

    def stop(self, seq: int) -> None:
        self.call("stop", {"Stop": seq})

    def respond(self, query_id: int, payload: bytes) -> None:
        self.call("respond", {"ID": query_id, "Payload": payload})

    def query(
        self, name: str, payload: bytes, *, timeout_s: float = 0.0, request_ack: bool = False
    ) -> Iterator[QueryRecord]:
        """Send a query; yields its acks and responses until Serf says done."""
        body = {
            "FilterNodes": [], "FilterTags": {}, "RequestAck": request_ack,
            "Timeout": int(timeout_s * 1e9), "Name": name, "Payload": payload,
        }  # fmt: skip
        seq = self.call("query", body).seq
        deadline = time.monotonic() + (timeout_s or 15.0) + self.timeout_s
        for _ in range(QUERY_RECORDS_MAX):
            rec = self._record_of(seq, deadline)
            if rec is None or rec.type == "done":
                return
            yield rec

    def _record_of(self, seq: int, deadline: float) -> QueryRecord | None:
        """The next record of query `seq`; other records stay queued for next_record()."""
        for i, rec in enumerate(self._records):
            if isinstance(rec, QueryRecord) and rec.seq == seq:
                del self._records[i]
                return rec
        with self._lock:
            while True:
                try:
                    ev = self._next(deadline)
                except TimeoutError:
                    return None
                if isinstance(ev, QueryRecord) and ev.seq == seq:
                    return ev
                self._keep(ev)
