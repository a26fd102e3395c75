"""Control server with a real engine: auth, tenant isolation, bad frames, pipelining.

The server runs in its own event-loop thread; clients are real sockets (ControlChannel, raw
sockets for malformed input). No NVMe/TCP here: hello's data-path address is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.control import ControlServer, TenantRegistry
from dpu_agent.engine import Engine, EngineConfig
from host_shim.client import ControlChannel, ControlError
from kvproto.checksum import chunk_checksum
from kvproto.control import ADMIN_TENANT, CONTROL_FRAME_BYTES_MAX, PROTOCOL_VERSION

TOKENS = {"alpha": "token-alpha", "beta": "token-beta"}
ADMIN = "token-admin"
KEYS = [bytes([i]) * 16 for i in range(1, 9)]
DATA = [bytes([i]) * 5000 for i in range(1, 9)]


class Backend:
    """The engine plus what hello and members report; admin ops are the service's business."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lease_ttl_s = 30.0

    def hello_info(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        return {"nvme": {"host": "127.0.0.1", "port": 0, "subnqn": f"nqn.test:{tenant}"}}

    def bind_host(self, session: Any, hostnqn: str) -> None:
        pass  # no data plane here

    def session_closed(self, session: Any) -> None:
        pass

    def members(self) -> list[dict[str, Any]]:
        return [{"name": "test", "control": "", "nvme": "", "capacity_bytes": 0}]

    def tenants_list(self) -> list[dict[str, Any]]:
        return [{"name": n} for n in TOKENS]

    async def admin(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        if op == "checkpoint":
            return {"checkpoint": await asyncio.to_thread(self.engine.checkpoint)}
        raise ValueError(f"{op} not in this test backend")


@contextlib.contextmanager
def serving(engine: Engine, **kw: Any) -> Iterator[ControlServer]:
    """A ControlServer over `engine` in its own event-loop thread."""
    loop = asyncio.new_event_loop()
    srv = ControlServer(Backend(engine), TenantRegistry(ADMIN, TOKENS), host="127.0.0.1", port=0,
                        **kw)  # fmt: skip
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield srv
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp: Path = tmp_path_factory.mktemp("ctl")
    e = Engine(EngineConfig(data_dir=tmp, dram_bytes=1 << 20, nvme_bytes=4 << 20,
                            tenants={n: 0 for n in TOKENS}))  # fmt: skip
    for key, data in zip(KEYS, DATA, strict=True):
        e.put_chunk("alpha", key, data)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlServer]:
    with serving(engine, unix_path=tmp_path_factory.mktemp("sock") / "ctl.sock") as srv:
        yield srv


def url(srv: ControlServer) -> str:
    assert srv.tcp_address is not None
    return f"tcp://{srv.tcp_address[0]}:{srv.tcp_address[1]}"


def channel(srv: ControlServer, tenant: str, token: str | None = None) -> ControlChannel:
    ch = ControlChannel(url(srv), tenant, token if token is not None else TOKENS[tenant])
    ch.connect()
    return ch


def test_lookup_prefix_with_lease_then_release(server: ControlServer) -> None:
    with channel(server, "alpha") as ch:
        assert ch.hello["version"] == PROTOCOL_VERSION
        res = ch.call("lookup", keys=[*KEYS[:3], b"\xee" * 16, KEYS[4]])
        assert [h[0] for h in res["hits"]] == KEYS[:3]  # the prefix stops at the miss
        key, _nsid, _lba, blocks, length, checksum = res["hits"][0]
        assert length == 5000 and blocks == 2 and checksum == chunk_checksum(key, DATA[0])
        assert res["lease_id"] > 0
        ch.call("release", lease_id=res["lease_id"])
        with pytest.raises(ControlError) as e:
            ch.call("release", lease_id=res["lease_id"])
        assert e.value.code == "not_found"


def test_unix_socket_serves_too(server: ControlServer) -> None:
    with ControlChannel(f"unix://{server.unix_path}", "alpha", TOKENS["alpha"]) as ch:
        ch.connect()
        assert len(ch.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)


@pytest.mark.parametrize(
    ("tenant", "token"), [("alpha", "wrong"), ("gamma", "token-alpha"), (ADMIN_TENANT, "x")]
)
def test_wrong_token_or_unknown_tenant_refused(
    server: ControlServer, tenant: str, token: str
) -> None:
    with pytest.raises(ControlError) as e:
        channel(server, tenant, token)
    assert e.value.code == "auth" and "token" in e.value.message


def test_request_before_hello_refused(server: ControlServer) -> None:
    reply = raw_exchange(server, {"id": 5, "op": "lookup", "keys": KEYS[:1]})
    assert reply["id"] == 5 and reply["ok"] is False and reply["error"] == "auth"
    assert "hello first" in reply["message"]


def test_version_mismatch_says_so(server: ControlServer) -> None:
    hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION + 1, "tenant": "alpha",
             "token": TOKENS["alpha"]}  # fmt: skip
    reply = raw_exchange(server, hello)
    assert reply["error"] == "version" and f"speaks version {PROTOCOL_VERSION}" in reply["message"]


def test_tenant_b_cannot_see_a_even_with_a_keys(server: ControlServer) -> None:
    with channel(server, "beta") as b, channel(server, "alpha") as a:
        assert b.call("lookup", keys=KEYS)["hits"] == []
        for op in ("delete", "pin"):
            with pytest.raises(ControlError) as e:
                b.call(op, key=KEYS[0])
            assert e.value.code == "not_found"
        lease = a.call("lookup", keys=KEYS[:1])["lease_id"]
        with pytest.raises(ControlError):  # not B's lease
            b.call("release", lease_id=lease)
        stats = b.call("stats")["stats"]
        assert stats["tenant"] == "beta" and stats["records"] == 0
        assert len(a.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)
        a.call("release", lease_id=lease)


def test_admin_ops_refused_to_tenants_and_allowed_to_admin(server: ControlServer) -> None:
    with channel(server, "alpha") as a:
        with pytest.raises(ControlError) as e:
            a.call("checkpoint")
        assert e.value.code == "forbidden"
    with channel(server, ADMIN_TENANT, ADMIN) as adm:
        assert adm.call("checkpoint")["checkpoint"]["records"] >= 0
        assert set(adm.call("stats")["stats"]["tenants"]) == set(TOKENS)
        with pytest.raises(ControlError) as e:
            adm.call("lookup", keys=KEYS)
        assert e.value.code == "forbidden"


def test_reserve_commit_roundtrip_and_commit_checksum(server: ControlServer) -> None:
    key, data = b"\x42" * 16, b"z" * 4096
    with channel(server, "beta") as b:
        r = b.call("reserve", key=key, length=len(data))
        b.call("commit", reservation_id=r["reservation_id"], checksum=chunk_checksum(key, data))
        assert len(b.call("lookup", keys=[key], lease=False)["hits"]) == 1
        b.call("delete", key=key)
        assert b.call("lookup", keys=[key])["hits"] == []


def test_pipelined_requests_answer_in_order(server: ControlServer) -> None:
    with channel(server, "alpha") as a:
        reqs = [("lookup", {"keys": KEYS[: 1 + i % 8], "lease": False}) for i in range(300)]
        replies = a.pipeline(reqs)
        assert [len(r.result["hits"]) for r in replies] == [1 + i % 8 for i in range(300)]


def raw_exchange(srv: ControlServer, msg: dict[str, Any] | bytes) -> dict[str, Any]:
    assert srv.tcp_address is not None
    with socket.create_connection(srv.tcp_address, timeout=10) as s:
        body = msg if isinstance(msg, bytes) else msgpack.packb(msg)
        s.sendall(struct.pack(">I", len(body)) + body)
        return read_frame(s)


def read_frame(s: socket.socket) -> dict[str, Any]:
    head = recv_exact(s, 4)
    (n,) = struct.unpack(">I", head)
    return msgpack.unpackb(recv_exact(s, n))


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "server closed"
        buf += chunk
    return buf


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", CONTROL_FRAME_BYTES_MAX + 1),
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # never-used msgpack byte
        struct.pack(">I", 1) + b"\x01",  # not a map
        struct.pack(">I", 0),
    ],
)
def test_bad_frames_get_an_error_and_others_keep_being_served(
    server: ControlServer, garbage: bytes
) -> None:
    with channel(server, "alpha") as good:
        assert server.tcp_address is not None
        with socket.create_connection(server.tcp_address, timeout=10) as bad:
            bad.sendall(garbage)
            reply = read_frame(bad)
            assert reply["ok"] is False and reply["error"] == "protocol"
            assert bad.recv(1) == b""  # closed after a framing error
        assert len(good.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)


def test_bad_request_in_good_frame_keeps_the_connection(server: ControlServer) -> None:
    assert server.tcp_address is not None
    with socket.create_connection(server.tcp_address, timeout=10) as s:
        hello = {"id": 8, "op": "hello", "version": PROTOCOL_VERSION, "tenant": "alpha",
                 "token": TOKENS["alpha"]}  # fmt: skip
        body = msgpack.packb(hello)
        s.sendall(struct.pack(">I", len(body)) + body)
        assert read_frame(s)["ok"] is True  # (a request before hello closes: test_hostile_*)
        for msg in ({"id": 9, "op": "frobnicate"}, {"id": 10, "op": "lookup", "keys": ["x"]}):
            body = msgpack.packb(msg)
            s.sendall(struct.pack(">I", len(body)) + body)
            reply = read_frame(s)
            assert reply["id"] == msg["id"] and reply["error"] in ("protocol", "auth")
        body = msgpack.packb({"id": 11, "op": "lookup", "keys": [], "lease": False})
        s.sendall(struct.pack(">I", len(body)) + body)
        assert read_frame(s)["ok"] is True


def test_token_guessing_closes_the_connection(server: ControlServer) -> None:
    assert server.tcp_address is not None
    with socket.create_connection(server.tcp_address, timeout=10) as s:
        for i in range(3):
            hello = {"id": i + 1, "op": "hello", "version": PROTOCOL_VERSION, "tenant": "alpha",
                     "token": f"guess{i}"}  # fmt: skip
            body = msgpack.packb(hello)
            s.sendall(struct.pack(">I", len(body)) + body)
            assert read_frame(s)["error"] == "auth"
        assert s.recv(1) == b""


def test_abort_gives_a_reservation_back_once(server: ControlServer) -> None:
    with channel(server, "beta") as b:
        r = b.call("reserve", key=b"\x43" * 16, length=4096)
        b.call("abort", reservation_id=r["reservation_id"])
        with pytest.raises(ControlError) as e:
            b.call("commit", reservation_id=r["reservation_id"], checksum=b"\0" * 16)
        assert e.value.code == "not_found"
        assert b.call("stats")["stats"]["reservations"] == 0


@settings(max_examples=60, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=300))
def test_fuzz_random_bytes_never_disturb_the_server(server: ControlServer, garbage: bytes) -> None:
    assert server.tcp_address is not None
    with socket.create_connection(server.tcp_address, timeout=10) as bad:
        bad.sendall(garbage)
        bad.shutdown(socket.SHUT_WR)
        bad.settimeout(10)
        while bad.recv(65536):  # whatever the server answers, it then closes or waits for more
            pass
    with channel(server, "alpha") as good:
        assert len(good.call("lookup", keys=KEYS[:2], lease=False)["hits"]) == 2


def test_posted_requests_cost_no_round_trip_and_keep_order(server: ControlServer) -> None:
    with channel(server, "alpha") as a:
        for _ in range(300):  # more than PIPELINE_DEPTH_MAX posts: drained on the way
            lease = a.call("lookup", keys=KEYS[:2])["lease_id"]
            a.post([("release", {"lease_id": lease}), ("release", {"lease_id": lease})])
        assert len(a.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)
        assert a.call("stats")["stats"]["leases"] == 0


def test_client_that_never_reads_replies_does_not_stall_others(server: ControlServer) -> None:
    """Replies pile up for a client that only sends: the server stops reading from it (bounded
    memory) and keeps serving everyone else."""
    assert server.tcp_address is not None
    hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "tenant": "alpha",
             "token": TOKENS["alpha"]}  # fmt: skip
    lookup = msgpack.packb({"id": 2, "op": "lookup", "keys": KEYS, "lease": False})
    wire = b"".join(struct.pack(">I", len(f)) + f for f in (msgpack.packb(hello), lookup))
    wire += (struct.pack(">I", len(lookup)) + lookup) * 300_000  # ~50 MB: past any socket buffers
    with socket.create_connection(server.tcp_address, timeout=10) as hog:
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.setblocking(False)
        sent, stalled_since = 0, time.monotonic()
        while sent < len(wire) and time.monotonic() - stalled_since < 0.5:  # ends: wire size
            try:
                sent += hog.send(wire[sent : sent + 65536])
                stalled_since = time.monotonic()
            except BlockingIOError:
                time.sleep(0.01)
        assert sent < len(wire), "the server kept reading a client that never reads"
        with channel(server, "alpha") as good:
            t0 = time.monotonic()
            assert len(good.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)
            assert time.monotonic() - t0 < 2.0


def test_pipeline_of_large_requests_is_batched_by_bytes(server: ControlServer) -> None:
    many = [*KEYS, *(bytes([0xF0, i >> 8, i & 0xFF]) * 5 + b"\0" for i in range(4088))]
    with channel(server, "alpha") as a:
        replies = a.pipeline([("lookup", {"keys": many, "lease": False})] * 40)  # ~2.9 MB
        assert [len(r.result["hits"]) for r in replies] == [len(KEYS)] * 40


def test_connections_over_the_limit_get_a_clear_error(engine: Engine) -> None:
    with serving(engine, connections_max=1) as srv, channel(srv, "alpha") as first:
        assert srv.tcp_address is not None
        with socket.create_connection(srv.tcp_address, timeout=10) as second:
            reply = read_frame(second)
            assert reply["ok"] is False and "connections_max" in reply["message"]
        assert len(first.call("lookup", keys=KEYS, lease=False)["hits"]) == len(KEYS)
