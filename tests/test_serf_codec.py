"""Serf RPC codec: one table of exchanges run whole, one byte at a time and with trailing bytes
(the next header's first bytes); the writer checked against the same table; fuzz invariant."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.serf import (
    NEED_DATA,
    LocalProtocolError,
    MemberEvent,
    QueryEvent,
    QueryRecord,
    RemoteProtocolError,
    Reply,
    SerfCodec,
    SerfState,
    UserEvent,
)


def member(name: str, status: str = "alive", **tags: str) -> dict[str, Any]:
    return {
        "Addr": b"\x7f\x00\x00\x01", "DelegateCur": 5, "DelegateMax": 5, "DelegateMin": 2,
        "Name": name, "Port": 7946, "ProtocolCur": 2, "ProtocolMax": 5, "ProtocolMin": 1,
        "Status": status, "Tags": tags,
    }  # fmt: skip


def hdr(seq: int, error: str = "") -> dict[str, Any]:
    return {"Error": error, "Seq": seq}


# (command, request body, agent's objects in reply, what the reader hands back)
# Seq numbers follow the table: the handshake is seq 0, then one per row. The agent's objects
# are what the live agent sent in tests/test_serf_live.py (same field names and shapes).
TABLE: list[tuple[str, dict[str, Any] | None, list[Any], list[Any]]] = [
    ("handshake", {"Version": 1}, [hdr(0)], [Reply(seq=0, command="handshake", error="")]),
    ("members", None, [hdr(1, "Authentication required")],
     [Reply(seq=1, command="members", error="Authentication required")]),
    ("auth", {"AuthKey": "k"}, [hdr(2)], [Reply(seq=2, command="auth", error="")]),
    ("members", None, [hdr(3), {"Members": [member("n1", role="x")]}],
     [("members", ["n1"])]),
    ("stream", {"Type": "*"}, [hdr(4)], [Reply(seq=4, command="stream", error="")]),
    ("event", {"Name": "ev", "Payload": b"xy", "Coalesce": False},
     [hdr(5), hdr(4), {"Coalesce": False, "Event": "user", "LTime": 1, "Name": "ev",
                       "Payload": b"xy"}],
     [Reply(seq=5, command="event", error=""),
      UserEvent(seq=4, ltime=1, name="ev", payload=b"xy", coalesce=False)]),
    ("query", {"FilterNodes": [], "FilterTags": {}, "RequestAck": True, "Timeout": 0,
               "Name": "q", "Payload": b"p"},
     [hdr(6), hdr(4), {"Event": "query", "ID": 1, "LTime": 1, "Name": "q", "Payload": b"p"},
      hdr(6), {"From": "n1", "Payload": None, "Type": "ack"},
      hdr(6), {"From": "", "Payload": None, "Type": "done"}],
     [Reply(seq=6, command="query", error=""),
      QueryEvent(seq=4, id=1, ltime=1, name="q", payload=b"p"),
      QueryRecord(seq=6, type="ack", from_="n1", payload=b""),
      QueryRecord(seq=6, type="done", from_="", payload=b"")]),
    ("tags", {"Tags": {"c": "d"}, "DeleteTags": ["a"]},
     [hdr(7), hdr(4), {"Event": "member-update", "Members": [member("n1", c="d")]}],
     [Reply(seq=7, command="tags", error=""), ("member-update", ["n1"])]),
    ("join", {"Existing": ["127.0.0.1:1"], "Replay": False},
     [hdr(8, "1 error occurred: refused"), {"Num": 0}],
     [Reply(seq=8, command="join", error="1 error occurred: refused", body={"Num": 0})]),
    ("stop", {"Stop": 4}, [hdr(9)], [Reply(seq=9, command="stop", error="")]),
    ("leave", None, [hdr(10)], [Reply(seq=10, command="leave", error="")]),
    # keyring commands: a body follows every reply, errors included (live agent, 0.8.2)
    ("list-keys", None,
     [hdr(11), {"Keys": {"a2V5": 2}, "Messages": {}, "NumErr": 0, "NumNodes": 2, "NumResp": 2}],
     [Reply(seq=11, command="list-keys", error="", body={
         "Keys": {"a2V5": 2}, "Messages": {}, "NumErr": 0, "NumNodes": 2, "NumResp": 2})]),
    ("install-key", {"Key": "a2V5"},
     [hdr(12), {"Keys": None, "Messages": {}, "NumErr": 0, "NumNodes": 2, "NumResp": 2}],
     [Reply(seq=12, command="install-key", error="", body={
         "Keys": None, "Messages": {}, "NumErr": 0, "NumNodes": 2, "NumResp": 2})]),
    ("remove-key", {"Key": "a2V5"},
     [hdr(13, "2/2 nodes reported failure"),
      {"Keys": None, "Messages": {"n1": "Removing the primary key is not allowed"},
       "NumErr": 1, "NumNodes": 1, "NumResp": 1}],
     [Reply(seq=13, command="remove-key", error="2/2 nodes reported failure", body={
         "Keys": None, "Messages": {"n1": "Removing the primary key is not allowed"},
         "NumErr": 1, "NumNodes": 1, "NumResp": 1})]),
    ("use-key", {"Key": "a2V5"},
     [hdr(14), {"Keys": None, "Messages": {}, "NumErr": 0, "NumNodes": 1, "NumResp": 1}],
     [Reply(seq=14, command="use-key", error="", body={
         "Keys": None, "Messages": {}, "NumErr": 0, "NumNodes": 1, "NumResp": 1})]),
]  # fmt: skip


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, tuple):  # (members reply or member event, names)
        kind, names = want
        if kind == "members":
            return isinstance(got, Reply) and [m.name for m in got.members] == names
        return (
            isinstance(got, MemberEvent)
            and got.event == kind
            and [m.name for m in got.members] == names
        )
    return bool(got == want)


def _run(step: int, trailing: bytes = b"") -> list[Any]:
    codec, out = SerfCodec(), []
    for command, body, agent, _ in TABLE:
        codec.send(command, body)
        wire_in = b"".join(msgpack.packb(o) for o in agent)
        for i in range(0, len(wire_in), step):
            codec.receive_data(wire_in[i : i + step])
            while (ev := codec.next_event()) is not NEED_DATA:
                out.append(ev)
    codec.receive_data(trailing)
    assert codec.next_event() is NEED_DATA  # a partial header is not an event, nor an error
    return out


@pytest.mark.parametrize(
    "step,trailing", [(1 << 30, b""), (1, b""), (5, msgpack.packb(hdr(11))[:4])]
)
def test_table_whole_bytewise_and_with_trailing_bytes(step: int, trailing: bytes) -> None:
    got = _run(step, trailing)
    want = [w for *_, ws in TABLE for w in ws]
    assert len(got) == len(want), got
    for g, w in zip(got, want, strict=True):
        assert _same(g, w), (g, w)


def test_writer_matches_table() -> None:
    codec = SerfCodec()
    for seq, (command, body, *_rest) in enumerate(TABLE):
        got_seq, wire = codec.send(command, body)
        assert got_seq == seq
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(wire)
        objs = list(unpacker)
        assert objs[0] == {"Command": command, "Seq": seq}
        assert objs[1:] == ([body] if body is not None else [])
        codec.receive_data(b"".join(msgpack.packb(o) for o in TABLE[seq][2]))
        while codec.next_event() is not NEED_DATA:
            pass


def test_stopped_stream_records_in_flight_are_dropped() -> None:
    codec = _open_codec()
    stream_seq, _ = codec.send("stream", {"Type": "member-join"})
    stop_seq, _ = codec.send("stop", {"Stop": stream_seq})
    late = {"Event": "member-join", "Members": [member("n2")]}
    objs = [hdr(stream_seq), hdr(stop_seq), hdr(stream_seq), late]
    codec.receive_data(b"".join(msgpack.packb(o) for o in objs))
    evs = []
    while (ev := codec.next_event()) is not NEED_DATA:
        evs.append(ev)
    assert [type(e) for e in evs] == [Reply, Reply]
    assert codec.outstanding == 0


def _open_codec() -> SerfCodec:
    codec = SerfCodec()
    codec.send("handshake", {"Version": 1})
    codec.receive_data(msgpack.packb(hdr(0)))
    assert isinstance(codec.next_event(), Reply)
    assert codec.state is SerfState.OPEN
    return codec


def test_local_errors() -> None:
    codec = SerfCodec()
    with pytest.raises(LocalProtocolError, match="cannot send members in state new"):
        codec.send("members")
    with pytest.raises(LocalProtocolError, match="unknown Serf RPC command"):
        codec.send("members-all")
    with pytest.raises(LocalProtocolError, match="body required"):
        codec.send("handshake")
    codec.send("handshake", {"Version": 1})
    with pytest.raises(LocalProtocolError, match="in state handshaking"):
        codec.send("members")  # the agent refuses anything before the handshake's reply
    codec = _open_codec()
    with pytest.raises(LocalProtocolError, match="no stream or monitor"):
        codec.send("stop", {"Stop": 99})


@pytest.mark.parametrize(
    "objs,match",
    [
        ([hdr(7)], "no outstanding command"),
        ([{"Seq": 1}], "expected a response header"),
        ([hdr(1), [1, 2]], "not a map"),
        ([hdr(1), {"Members": [{"Name": "x", "Addr": b"\x01\x02", "Port": 1,
                                        "Status": "alive"}]}], "Addr of 2 bytes"),
        ([hdr(1), {"Members": [member("x", status="zombie")]}], "Status"),
    ],
)  # fmt: skip
def test_remote_errors_then_error_state(objs: list[Any], match: str) -> None:
    codec = _open_codec()
    codec.send("members")
    codec.receive_data(b"".join(msgpack.packb(o) for o in objs))
    with pytest.raises(RemoteProtocolError, match=match):
        while codec.next_event() is not NEED_DATA:
            pass
    with pytest.raises(RemoteProtocolError):  # every later call raises again
        codec.next_event()
    with pytest.raises(RemoteProtocolError):
        codec.send("members")


def test_refused_handshake_is_error_state() -> None:
    codec = SerfCodec()
    codec.send("handshake", {"Version": 2})
    codec.receive_data(msgpack.packb(hdr(0, "Unsupported IPC version")))
    ev = codec.next_event()
    assert isinstance(ev, Reply) and ev.error == "Unsupported IPC version"
    assert codec.state is SerfState.ERROR
    with pytest.raises(RemoteProtocolError, match="refused the handshake"):
        codec.send("members")


def test_oversized_message_is_refused_not_buffered() -> None:
    from kvproto.serf import SERF_MESSAGE_BYTES_MAX

    codec = _open_codec()
    with pytest.raises(RemoteProtocolError, match="SERF_MESSAGE_BYTES_MAX"):
        codec.receive_data(b"\xc6" + (SERF_MESSAGE_BYTES_MAX + 1).to_bytes(4, "big"))
        codec.receive_data(b"\x00" * (SERF_MESSAGE_BYTES_MAX + 8))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from(["members", "stream", "join", "query"]))
def test_fuzz_anything_parses_or_raises_remote_protocol_error(data: bytes, command: str) -> None:
    codec = _open_codec()
    body = None if command == "members" else {}
    codec.send(command, body)
    try:
        codec.receive_data(msgpack.packb(hdr(1)) + data)
        for _ in range(len(data) + 4):
            if codec.next_event() is NEED_DATA:
                break
    except RemoteProtocolError:
        pass
