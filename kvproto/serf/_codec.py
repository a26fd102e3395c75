"""Serf's RPC protocol (the agent's `-rpc-addr` listener), client side, sans-I/O.

Wire format (hashicorp/serf client/const.go, command/agent/ipc.go): a stream of msgpack
objects. Each request is a header map ``{"Command": str, "Seq": u64}`` followed, for commands
that take arguments, by a body map; each response is a header ``{"Seq": u64, "Error": str}``
followed, for commands that return data (members, members-filtered, join, stats), by a body.
Headers alone never say whether a body follows: the codec remembers each outstanding seq's
command. The generic refusals (handshake or auth required, unknown command) have no body.

`stream`, `monitor` and `query` are streaming: the first header acknowledges (or refuses) the
command, then every later header with the same seq is followed by one record (a member, user
or query event; a log line; a query ack/response/done). A query ends with its ``done`` record;
a stream or monitor ends with a `stop` naming its seq.

    codec = SerfCodec()
    sock.sendall(codec.send("handshake", {"Version": 1}))
    codec.receive_data(sock.recv(65536))
    while (ev := codec.next_event()) is not NEED_DATA: ...

After any protocol error the codec is in ERROR and every call raises again.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import msgpack

from kvproto.serf._errors import LocalProtocolError, RemoteProtocolError
from kvproto.serf._events import (
    Member,
    Reply,
    StreamRecord,
    log_record,
    members_of,
    query_record,
    stream_record,
)

__all__ = [
    "COMMANDS",
    "IPC_VERSION",
    "NEED_DATA",
    "SERF_MESSAGE_BYTES_MAX",
    "SerfCodec",
    "SerfState",
]

IPC_VERSION: Final = 1  # the only version Serf's RPC has ever spoken (MinIPCVersion = Max = 1)
# One msgpack object from the agent: a members reply of 4,096 nodes with full tags (Serf caps
# tags at 512 bytes a node) is ~2.5 MiB; 8 MiB bounds what a broken agent can make us hold.
SERF_MESSAGE_BYTES_MAX: Final = 8 << 20
# Requests awaiting their reply plus live streams: the agent answers in order, so a client
# has a handful outstanding; 4,096 is a leak or a bug.
PENDING_MAX: Final = 4096
# Seqs of streams we stopped: records already in flight still arrive (header + body) and are
# dropped. Remembering the last 64 is plenty (a client stops one stream at a time).
STOPPED_MAX: Final = 64
_SEQ_MAX: Final = (1 << 64) - 1


class _Kind(enum.Enum):
    HEADER = "header"  # header only
    BODY = "body"  # header, then a body map
    STREAM = "stream"  # stream: ack header, then header + event record, until stopped
    MONITOR = "monitor"  # monitor: ack header, then header + log record, until stopped
    QUERY = "query"  # query: ack header, then header + query record, until "done"


# command -> (kind, whether it takes a body map)
COMMANDS: Final[dict[str, tuple[_Kind, bool]]] = {
    "handshake": (_Kind.HEADER, True),
    "auth": (_Kind.HEADER, True),
    "event": (_Kind.HEADER, True),
    "force-leave": (_Kind.HEADER, True),
    "join": (_Kind.BODY, True),
    "members": (_Kind.BODY, False),
    "members-filtered": (_Kind.BODY, True),
    "tags": (_Kind.HEADER, True),
    "stream": (_Kind.STREAM, True),
    "monitor": (_Kind.MONITOR, True),
    "stop": (_Kind.HEADER, True),
    "leave": (_Kind.HEADER, False),
    "query": (_Kind.QUERY, True),
    "respond": (_Kind.HEADER, True),
    "stats": (_Kind.BODY, False),
    # the gossip keyring, cluster-wide (Serf asks every member): a body follows every reply,
    # errors included (Messages says which node refused and why)
    "install-key": (_Kind.BODY, True),
    "use-key": (_Kind.BODY, True),
    "remove-key": (_Kind.BODY, True),
    "list-keys": (_Kind.BODY, False),
}
# Refusals sent before the command's handler runs: header only, whatever the command.
_NO_BODY_ERRORS: Final = frozenset(
    {"Authentication required", "Handshake required", "Unsupported command"}
)


class SerfState(enum.Enum):
    NEW = "new"  # nothing sent
    HANDSHAKING = "handshaking"  # handshake sent, no reply yet
    OPEN = "open"  # handshake accepted: any command (auth first when the agent has a key)
    ERROR = "error"


class _Ev(enum.Enum):
    SEND_HANDSHAKE = "send_handshake"
    SEND_OTHER = "send_other"
    HANDSHAKE_OK = "handshake_ok"
    HANDSHAKE_REFUSED = "handshake_refused"


# Every transition of the connection; a pair missing here is a protocol error.
_TRANSITIONS: Final[dict[tuple[SerfState, _Ev], SerfState]] = {
    (SerfState.NEW, _Ev.SEND_HANDSHAKE): SerfState.HANDSHAKING,
    (SerfState.HANDSHAKING, _Ev.HANDSHAKE_OK): SerfState.OPEN,
    (SerfState.HANDSHAKING, _Ev.HANDSHAKE_REFUSED): SerfState.ERROR,
    (SerfState.OPEN, _Ev.SEND_OTHER): SerfState.OPEN,
}


class _NeedData(enum.Enum):
    NEED_DATA = "need_data"


NEED_DATA: Final = _NeedData.NEED_DATA


@dataclass(slots=True)
class _Pending:
    command: str
    kind: _Kind
    acked: bool = False  # streaming commands: the first header came


class SerfCodec:
    """One RPC connection's state: seq numbers, outstanding commands, bytes in and events out."""

    def __init__(self) -> None:
        self.state = SerfState.NEW
        self._next_seq = 0
        self._pending: dict[int, _Pending] = {}
        self._stopped: OrderedDict[int, None] = OrderedDict()
        self._stopping: dict[int, int] = {}  # seq of a stop request -> the stream it stops
        self._unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=SERF_MESSAGE_BYTES_MAX,
            use_list=True, max_ext_len=0,
        )  # fmt: skip
        self._header: tuple[int, str] | None = None  # a header whose body has not come yet
        self._error: RemoteProtocolError | None = None

    # --- sending ------------------------------------------------------------------------------
    def send(self, command: str, body: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
        """The seq and the bytes of one request. LocalProtocolError for a command Serf does
        not know, a body where none belongs (or none where one does), or out of order."""
        self._check()
        if command not in COMMANDS:
            raise LocalProtocolError(f"unknown Serf RPC command {command!r}")
        kind, has_body = COMMANDS[command]
        if has_body != (body is not None):
            raise LocalProtocolError(f"{command}: body {'required' if has_body else 'not taken'}")
        ev = _Ev.SEND_HANDSHAKE if command == "handshake" else _Ev.SEND_OTHER
        nxt = _TRANSITIONS.get((self.state, ev))
        if nxt is None:
            raise LocalProtocolError(f"cannot send {command} in state {self.state.value}")
        if len(self._pending) >= PENDING_MAX:
            raise LocalProtocolError(f"{PENDING_MAX} commands outstanding; read the replies")
        if command == "stop":
            stop = body["Stop"] if body is not None else None
            if self._pending.get(stop) is None:  # type: ignore[arg-type]
                raise LocalProtocolError(f"stop: no stream or monitor with seq {stop!r}")
        seq = self._next_seq
        self._next_seq = 0 if seq == _SEQ_MAX else seq + 1
        data = msgpack.packb({"Command": command, "Seq": seq}, use_bin_type=True)
        if body is not None:
            data += msgpack.packb(dict(body), use_bin_type=True)
        self.state = nxt
        self._pending[seq] = _Pending(command, kind)
        if command == "stop":
            self._stopping[seq] = body["Stop"]  # type: ignore[index]
        return seq, data

    # --- receiving ----------------------------------------------------------------------------
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            self._fail(f"agent sent a message over SERF_MESSAGE_BYTES_MAX={SERF_MESSAGE_BYTES_MAX}")

    def next_event(self) -> Reply | StreamRecord | _NeedData:
        """The next reply or stream record; NEED_DATA when more bytes are needed."""
        self._check()
        while True:
            try:
                obj = self._unpacker.unpack()
            except msgpack.OutOfData:
                return NEED_DATA
            except Exception as e:  # msgpack raises many types (ValueError, StackError, ...)
                self._fail(f"bad msgpack from the agent: {type(e).__name__}: {e}"[:200])
            if self._header is None:
                out = self._on_header(obj)
            else:
                seq, error = self._header
                self._header = None
                out = self._on_body(seq, error, obj)
            if out is not None:
                return out

    @property
    def outstanding(self) -> int:
        """Commands awaiting replies plus live streams."""
        return len(self._pending)

    # --- internals ----------------------------------------------------------------------------
    def _on_header(self, obj: Any) -> Reply | StreamRecord | None:
        if not isinstance(obj, dict) or set(obj) != {"Seq", "Error"}:
            self._fail(f"expected a response header {{Seq, Error}}, got {obj!r:.80}")
        seq, error = obj["Seq"], obj["Error"]
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(error, str):
            self._fail(f"response header with Seq {seq!r:.40} and Error {error!r:.40}")
        p = self._pending.get(seq)
        if p is None:
            if seq in self._stopped:  # a record of a stopped stream, still in flight
                self._header = (seq, error)
                return None
            self._fail(f"response for seq {seq}, which has no outstanding command")
        assert p is not None
        streaming = p.kind in (_Kind.STREAM, _Kind.MONITOR, _Kind.QUERY)
        if streaming and p.acked:
            self._header = (seq, error)  # a record follows
            return None
        if p.kind is _Kind.BODY and error not in _NO_BODY_ERRORS:
            self._header = (seq, error)
            return None
        return self._finish(seq, p, error, None)

    def _on_body(self, seq: int, error: str, obj: Any) -> Reply | StreamRecord | None:
        p = self._pending.get(seq)
        if p is None:  # stopped stream: drop the record
            return None
        if p.kind is _Kind.BODY:
            if not isinstance(obj, dict):
                self._fail(f"{p.command} reply body is {type(obj).__name__}, not a map")
            return self._finish(seq, p, error, obj)
        try:
            if p.kind is _Kind.STREAM:
                return stream_record(seq, obj)
            if p.kind is _Kind.MONITOR:
                return log_record(seq, obj)
            rec = query_record(seq, obj)
        except RemoteProtocolError as e:
            self._fail(str(e))
        if rec.type == "done":
            del self._pending[seq]
        return rec

    def _finish(self, seq: int, p: _Pending, error: str, body: Any) -> Reply:
        if p.command == "handshake":
            ev = _Ev.HANDSHAKE_REFUSED if error else _Ev.HANDSHAKE_OK
            self.state = _TRANSITIONS[(SerfState.HANDSHAKING, ev)]
        if p.kind in (_Kind.STREAM, _Kind.MONITOR, _Kind.QUERY) and not error:
            p.acked = True  # the stream lives on under this seq
        else:
            del self._pending[seq]
        stopped = self._stopping.pop(seq, None)
        if stopped is not None and stopped in self._pending:
            del self._pending[stopped]
            self._stopped[stopped] = None
            while len(self._stopped) > STOPPED_MAX:
                self._stopped.popitem(last=False)
        members: tuple[Member, ...] = ()
        if p.command in ("members", "members-filtered") and body is not None:
            try:
                members = members_of(p.command, body)
            except RemoteProtocolError as e:
                self._fail(str(e))
        return Reply(seq=seq, command=p.command, error=error, body=body, members=members)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self.state is SerfState.ERROR:
            raise RemoteProtocolError("the agent refused the handshake; open a new connection")

    def _fail(self, message: str) -> NoReturn:
        self._error = RemoteProtocolError(message)
        self.state = SerfState.ERROR
        raise self._error
