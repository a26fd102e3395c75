"""Serf's RPC protocol, client side, sans-I/O (the PyPI clients are unmaintained).

`SerfCodec` turns commands into bytes and the agent's bytes into `Reply` and stream records
(`MemberEvent`, `UserEvent`, `QueryEvent`, `QueryRecord`, `LogRecord`). The socket loop around
it is `dpu_agent.cluster.SerfClient`.
"""

from kvproto.serf._codec import (
    COMMANDS,
    IPC_VERSION,
    NEED_DATA,
    SERF_MESSAGE_BYTES_MAX,
    SerfCodec,
    SerfState,
)
from kvproto.serf._errors import LocalProtocolError, ProtocolError, RemoteProtocolError, SerfError
from kvproto.serf._events import (
    MEMBER_STATUSES,
    LogRecord,
    Member,
    MemberEvent,
    QueryEvent,
    QueryRecord,
    Reply,
    StreamRecord,
    UserEvent,
)

__all__ = [
    "COMMANDS",
    "IPC_VERSION",
    "MEMBER_STATUSES",
    "NEED_DATA",
    "SERF_MESSAGE_BYTES_MAX",
    "LocalProtocolError",
    "LogRecord",
    "Member",
    "MemberEvent",
    "ProtocolError",
    "QueryEvent",
    "QueryRecord",
    "RemoteProtocolError",
    "Reply",
    "SerfCodec",
    "SerfError",
    "SerfState",
    "StreamRecord",
    "UserEvent",
]
