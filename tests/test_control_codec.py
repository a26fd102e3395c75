"""Control frames: one table run whole, byte at a time and with trailing bytes; fuzz invariant."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.control import (
    ADMIN_TENANT,
    CONTROL_FRAME_BYTES_MAX,
    HELLO_FRAME_BYTES_MAX,
    LOOKUP_KEYS_MAX,
    NEED_DATA,
    FrameDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    SessionState,
    encode_reply,
    encode_request,
    next_session_state,
    parse_reply,
    parse_request,
)

KEY = bytes(range(16))
REQUESTS: list[tuple[int, str, dict[str, Any]]] = [
    (1, "hello", {"version": 1, "tenant": "acme", "token": "t0k", "hostnqn": "nqn.x"}),
    (2, "lookup", {"keys": [KEY] * 64}),
    (3, "release", {"lease_id": 7}),
    (4, "reserve", {"key": KEY, "length": 4096, "parent": KEY}),
    (5, "commit", {"reservation_id": 9, "checksum": b"\x01" * 16}),
    (6, "delete", {"key": KEY}),
    (7, "stats", {}),
    (8, "backup", {"dir": "/tmp/b", "incremental": True}),
    (9, "restore", {"dirs": ["/a", "/b"]}),
    ((1 << 32) - 1, "members", {}),
]


def _decode_all(data: bytes, step: int) -> list[dict]:
    dec, out = FrameDecoder(), []
    for i in range(0, len(data), step):
        dec.receive_data(data[i : i + step])
        while (msg := dec.next_message()) is not NEED_DATA:
            out.append(msg)
    return out


@pytest.mark.parametrize("step", [1 << 30, 1, 7])
def test_request_table_round_trip(step: int) -> None:
    wire = b"".join(encode_request(rid, op, **f) for rid, op, f in REQUESTS)
    msgs = _decode_all(wire, step)
    assert len(msgs) == len(REQUESTS)
    for msg, (rid, op, f) in zip(msgs, REQUESTS, strict=True):
        req = parse_request(msg)
        assert (req.id, req.op, dict(req.fields)) == (rid, op, f)


def test_trailing_partial_frame_waits() -> None:
    wire = encode_request(1, "stats") + encode_request(2, "stats")[:3]
    dec = FrameDecoder()
    dec.receive_data(wire)
    assert parse_request(dec.next_message()).id == 1
    assert dec.next_message() is NEED_DATA
    assert dec.buffered_bytes == 3


def test_reply_round_trip() -> None:
    for reply in (
        Reply(id=3, ok=True, result={"hits": [[KEY, 1, 0, 1, 10, b"c" * 16]]}),
        Reply(id=4, ok=False, error="auth", message="wrong token for tenant acme"),
    ):
        dec = FrameDecoder()
        dec.receive_data(encode_reply(reply))
        assert parse_reply(dec.next_message()) == reply


def test_oversized_frame_refused_with_reason() -> None:
    dec = FrameDecoder()
    dec.receive_data(struct.pack(">I", CONTROL_FRAME_BYTES_MAX + 1))
    with pytest.raises(RemoteProtocolError, match="CONTROL_FRAME_BYTES_MAX"):
        dec.next_message()
    with pytest.raises(RemoteProtocolError):  # stays in error
        dec.next_message()


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        ({"id": 1, "op": "nope"}, "unknown op"),
        ({"id": -1, "op": "stats"}, "u32"),
        ({"id": 1, "op": "lookup"}, "missing field 'keys'"),
        ({"id": 1, "op": "lookup", "keys": [b"short"]}, "16-byte"),
        ({"id": 1, "op": "lookup", "keys": [KEY] * (LOOKUP_KEYS_MAX + 1)}, "at most"),
        ({"id": 1, "op": "reserve", "key": KEY, "length": 0}, "positive"),
        ({"id": 1, "op": "stats", "x": 1}, "unknown fields"),
        ({"id": 1, "op": "hello", "version": 1, "tenant": "A B", "token": ""}, "tenant name"),
        ([1, 2], "a map"),
        # a token an operator chose: a 1-character one was served (guessable by anyone)
        ({"id": 1, "op": "tenant_add", "tenant": "t", "token": "x"}, "at least 16"),
        # 1,100 characters, 4,400 bytes: accepted, then its file refused the agent's next start
        ({"id": 1, "op": "tenant_add", "tenant": "t", "token": "\U0001f600" * 1100}, "4096 bytes"),
        ({"id": 1, "op": "tenant_rotate", "tenant": "t", "token": "a" * 20 + " b"}, "spaces"),
    ],
)
def test_bad_requests_say_why(msg: object, reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        parse_request(msg)


def test_local_error_before_sending() -> None:
    with pytest.raises(LocalProtocolError, match="16"):
        encode_request(1, "delete", key=b"x")


def test_session_table() -> None:
    s = SessionState.AWAIT_HELLO
    with pytest.raises(RemoteProtocolError, match="hello first") as e:
        next_session_state(s, "lookup", admin=False)
    assert e.value.code == "auth"
    s = next_session_state(s, "hello", admin=False)
    assert next_session_state(s, "lookup", admin=False) is SessionState.READY
    with pytest.raises(RemoteProtocolError, match="admin"):
        next_session_state(s, "evict", admin=False)
    with pytest.raises(RemoteProtocolError, match="tenant session"):
        next_session_state(s, "lookup", admin=True)
    assert next_session_state(s, "checkpoint", admin=True) is SessionState.READY
    assert ADMIN_TENANT.startswith("_")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_any_bytes_parse_or_protocol_error(data: bytes) -> None:
    dec = FrameDecoder()
    try:
        dec.receive_data(data)
        while (msg := dec.next_message()) is not NEED_DATA:
            parse_request(msg)
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_framed_bodies(body: bytes) -> None:
    dec = FrameDecoder()
    try:
        dec.receive_data(struct.pack(">I", len(body)) + body)
        msg = dec.next_message()
        if msg is not NEED_DATA:
            parse_request(msg)
            parse_reply(msg)
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.binary(max_size=20)
        | st.text(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=20,
    )
)
def test_fuzz_structured_messages(obj: object) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    dec = FrameDecoder()
    try:
        dec.receive_data(struct.pack(">I", len(body)) + body)
        msg = dec.next_message()
        if msg is not NEED_DATA:
            parse_request(msg)
    except RemoteProtocolError:
        pass


def test_frames_before_hello_are_small_until_the_server_raises_the_bound() -> None:
    """A stranger announcing a 1 MiB frame is refused at its header: before hello a frame is at
    most HELLO_FRAME_BYTES_MAX (256 strangers each holding a 1 MiB partial frame held 290 MiB)."""
    big = encode_request(1, "lookup", keys=[bytes(16)] * 2000)  # ~36 KB, a legitimate request
    assert len(big) > HELLO_FRAME_BYTES_MAX
    dec = FrameDecoder(HELLO_FRAME_BYTES_MAX)
    dec.receive_data(big[:4])  # the header alone says it
    with pytest.raises(RemoteProtocolError, match="before hello"):
        dec.next_message()
    dec = FrameDecoder(HELLO_FRAME_BYTES_MAX)
    dec.receive_data(encode_request(1, "hello", version=1, tenant="t", token="x" * 44))
    assert dec.next_message() is not NEED_DATA
    dec.frame_bytes_max = CONTROL_FRAME_BYTES_MAX  # what the server does once hello succeeded
    dec.receive_data(big)
    assert parse_request(dec.next_message()).op == "lookup"


def test_a_reply_naming_every_tenant_an_agent_may_hold_decodes() -> None:
    """`stats` has a map per tenant: with more than 1,024 tenants the admin's reply was refused
    as bad msgpack (dpuctl stats said the agent was unreachable; an attack pass), though an
    agent may hold TENANTS_MAX."""
    from kvproto.control import TENANTS_MAX

    tenants = {f"t{i}": {"records": i, "bytes": i * 4096} for i in range(TENANTS_MAX)}
    (msg,) = _decode_all(encode_reply(Reply(id=1, ok=True, result={"tenants": tenants})), 1 << 30)
    assert len(parse_reply(msg).result["tenants"]) == TENANTS_MAX
