"""The NIXL metadata codec (dpu_agent.nixl._metadata): the layout nixl-cu12 writes parses, every
deviation is refused with a clear error, and no input raises anything else."""

from __future__ import annotations

import ipaddress
import random
import socket
import struct

import nixl_md
import pytest

from dpu_agent.nixl._metadata import DESCS_MAX, UCX_ADDRESS_BYTES_MAX, parse_metadata
from dpu_agent.nixl._server import NixlServer
from kvproto.control import NIXL_METADATA_BYTES_MAX, RemoteProtocolError

RKEY = b"\x01" * 9
DRAM, VRAM = 0, 1


def test_nixl_metadata_in_nixls_layout_parses() -> None:
    md = nixl_md.encode(b"dpukv.t.1", sections=[
        (b"UCX", DRAM, [(0x7F0000001000, 1 << 20, 0, RKEY), (0x7F0000200000, 4096, 0, RKEY)]),
        (b"UCX", VRAM, [(0x300000000, 1 << 30, 1, RKEY)]),
    ])  # fmt: skip
    got = parse_metadata(md)
    assert got.name == "dpukv.t.1" and got.backends == ("UCX",)
    assert got.regions == (
        (0x7F0000001000, 1 << 20, 0, "DRAM"),
        (0x7F0000200000, 4096, 0, "DRAM"),
        (0x300000000, 1 << 30, 1, "VRAM"),
    )
    assert parse_metadata(nixl_md.encode(b"dpukv.t.2")).regions == ()


@pytest.mark.parametrize(
    ("md", "why"),
    [
        (b"", "1 to"),
        (b"nixlSerDes|Agent", "truncated length"),
        (nixl_md.encode(b""), "printable ASCII"),
        (nixl_md.encode("é".encode()), "printable ASCII"),
        (nixl_md.encode(b"a" * 257), "max 256"),
        (nixl_md.encode(b"n", conns=[(b"GDS", nixl_md.UCX_ADDRESS)]), "backend 'GDS'"),
        (nixl_md.encode(b"n", conns=[(b"UCX", b"\x2f" + bytes(20))]), "format version 15"),
        (nixl_md.encode(b"n", conns=[(b"UCX", b"\x20" * 4)]), "UCX worker address of 4"),
        (nixl_md.encode(b"n", conns=[(b"UCX", b"\x20" * (UCX_ADDRESS_BYTES_MAX + 1))]), "max"),
        (nixl_md.encode(b"n", conns=[(b"UCX", nixl_md.UCX_ADDRESS)] * 2), "twice"),
        (nixl_md.encode(b"n", sections=[(b"UCX", 2, [(1, 1, 0, RKEY)])]), "memory type"),
        (nixl_md.encode(b"n", sections=[(b"UCX", DRAM, [])]), "empty descriptor list"),
        (nixl_md.encode(b"n", sections=[(b"UCX", DRAM, [(1, 1, 0, b"")])]), "no remote key"),
        (nixl_md.encode(b"n", sections=[(b"UCX", DRAM, [((1 << 64) - 1, 2, 0, RKEY)])]), "wraps"),
        (
            nixl_md.encode(b"n", conns=[], sections=[(b"UCX", DRAM, [(1, 1, 0, RKEY)])]),
            "no connection info",
        ),
        (nixl_md.encode(b"n") + b"x", "after the last section"),
        (nixl_md.encode(b"n")[:-1], "truncated"),
        (nixl_md.encode(b"n").replace(b"|Conns", b"|Connz"), "connection count"),
        (nixl_md.encode(b"n").replace(b"MemSection", b"MemSectioN"), "memory section"),
    ],
)
def test_nixl_metadata_deviations_are_refused_with_a_reason(md: bytes, why: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        parse_metadata(md)
    assert why in str(e.value), str(e.value)


def test_nixl_metadata_counts_past_their_maxima_are_refused_before_reading_on() -> None:
    md = nixl_md.encode(b"n", sections=[(b"UCX", DRAM, [(1, 1, 0, RKEY)])])
    i = md.index(b"|n\x08") + 2 + 8
    huge = md[:i] + struct.pack("<Q", DESCS_MAX + 1) + md[i + 8 :]
    with pytest.raises(RemoteProtocolError, match="descriptor count"):
        parse_metadata(huge)
    i = md.index(b"Conns") + 5 + 8
    many = md[:i] + struct.pack("<Q", 1 << 40) + md[i + 8 :]
    with pytest.raises(RemoteProtocolError, match="connection count"):
        parse_metadata(many)


def test_nixl_metadata_codec_fuzz_accepts_or_refuses_nothing_else() -> None:
    """Seeded mutations of a valid blob: each parses or raises RemoteProtocolError; what parses
    is within the stated limits."""
    base = nixl_md.encode(b"dpukv.t.fuzz", sections=[
        (b"UCX", DRAM, [(0x7F0000001000, 1 << 20, 0, RKEY)]),
    ])  # fmt: skip
    rng = random.Random(2027)
    accepted = refused = 0
    for _ in range(5000):
        b = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            op = rng.randrange(3)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1 and b:
                del b[rng.randrange(len(b)) :]
            else:
                i = rng.randrange(len(b) + 1)
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        try:
            md = parse_metadata(bytes(b[:NIXL_METADATA_BYTES_MAX]) or b"x")
        except RemoteProtocolError as e:
            assert str(e).startswith("nixl metadata:"), e
            refused += 1
            continue
        accepted += 1
        assert len(md.name) <= 256 and md.backends == ("UCX",)
        assert all(0 < n and a + n <= 1 << 64 for a, n, _, _ in md.regions)
    assert refused > accepted


@pytest.mark.parametrize(
    ("address", "ports"),
    [
        (nixl_md.UCX_ADDRESS, (49093, 40493)),
        (nixl_md.UCX_ADDRESS_V2, (33725, 41773)),
        (nixl_md.UCX_ADDRESS_SM, (39033, 34309)),
    ],
)
def test_ucx_worker_address_tcp_endpoints_are_read_from_ucxs_own_layout(
    address: bytes, ports: tuple[int, int]
) -> None:
    """Addresses UCX 1.23 packed (format v1, v2 with debug info, tcp beside sm and self): the
    tcp endpoints the agent's UCX would connect to, found by walking the whole address."""
    eth, lo = parse_metadata(nixl_md.encode(b"n", conns=[(b"UCX", address)])).tcp
    assert (eth.ip, eth.port) == (ipaddress.ip_address("192.0.2.2"), ports[0])
    assert (eth.ip, lo.ip, lo.port) == (eth.ip, None, ports[1])
    assert len(lo.local_id) == 12  # the system id and namespace UCX compares to its own


def test_ucx_worker_address_cut_or_padded_anywhere_is_refused() -> None:
    """Every truncation of a real address, and a byte after it, is refused (UCX itself reads
    with no length: a cut address reads past its end there)."""
    for address in (nixl_md.UCX_ADDRESS, nixl_md.UCX_ADDRESS_V2, nixl_md.UCX_ADDRESS_SM):
        for cut in range(9, len(address)):
            with pytest.raises(RemoteProtocolError, match="UCX"):
                parse_metadata(nixl_md.encode(b"n", conns=[(b"UCX", address[:cut])]))
        with pytest.raises(RemoteProtocolError, match="after the last device"):
            parse_metadata(nixl_md.encode(b"n", conns=[(b"UCX", address + b"\0")]))


def test_ucx_tcp_device_address_of_an_unknown_shape_is_refused() -> None:
    """A tcp entry whose device address is not an IPv4/IPv6 address or a loopback id: the
    agent cannot tell where UCX would connect, so it is refused."""
    a = nixl_md.UCX_ADDRESS
    i = a.index(bytes.fromhex("0002c0000202"))
    bad_family = a[:i] + bytes.fromhex("0007c0000202") + a[i + 6 :]
    with pytest.raises(RemoteProtocolError, match="family 7"):
        parse_metadata(nixl_md.encode(b"n", conns=[(b"UCX", bad_family)]))


def _aimed(ip: str) -> bytes:
    """nixl_md.UCX_ADDRESS with its tcp entry's IPv4 address (192.0.2.2) replaced."""
    a = nixl_md.UCX_ADDRESS
    old = bytes.fromhex("0002c0000202")
    assert a.count(old) == 1
    return nixl_md.encode(
        b"dpukv.t.1", conns=[(b"UCX", a.replace(old, b"\0\2" + socket.inet_aton(ip)))]
    )


@pytest.mark.parametrize(
    ("peer", "ip", "own_ids", "refused"),
    [
        ("198.51.100.7", "198.51.100.7", set(), False),  # the session's own host
        ("::ffff:198.51.100.7", "198.51.100.7", set(), False),  # a dual-stack socket's peer
        ("198.51.100.7", "198.51.100.8", set(), True),  # a third party
        ("198.51.100.7", "127.0.0.1", set(), True),  # the agent's own loopback, as an IP
        # the loopback entry: another machine's (UCX skips it) or this agent's (it connects)
        ("198.51.100.7", "198.51.100.7", {bytes.fromhex("25176a884ccca1b3")}, True),
        ("127.0.0.1", "127.0.0.1", {bytes.fromhex("25176a884ccca1b3")}, False),  # all local
        ("", "127.0.0.1", set(), False),  # the Unix socket is local too
        ("127.0.0.1", "198.51.100.8", set(), True),  # loopback sessions name this machine only
    ],
)
def test_ucx_endpoints_must_be_the_sessions_peer(
    peer: str, ip: str, own_ids: set[bytes], refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = NixlServer(lambda: None, "dpukv-agent.test")
    monkeypatch.setattr(server, "_own_system_ids", lambda: frozenset(own_ids))
    md = parse_metadata(_aimed(ip))
    if not refused:
        server._check_endpoints(md, peer)
        return
    with pytest.raises(RemoteProtocolError, match="UCX address points at") as e:
        server._check_endpoints(md, peer)
    assert e.value.code == "forbidden"


def test_a_connect_whose_session_closed_meanwhile_registers_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that gives up on its nixl_connect while the agent waits for its NIXL worker to
    start (seconds under load, the client's call gives up after 5 s) closes its session before
    the connect ends: the connect must not register it afterwards, or the host's NIXL agent
    name stays held by a dead session (its next session is refused NIXL) and the session
    table fills up."""
    import threading

    server = NixlServer(lambda: None, "dpukv-agent.test")
    loading, go_on = threading.Event(), threading.Event()

    def slow_load(tenant: str, md: object, metadata: bytes) -> None:
        loading.set()
        assert go_on.wait(10)

    monkeypatch.setattr(server, "_load", slow_load)
    failed: list[BaseException] = []

    def connect() -> None:
        try:
            server._nixl_connect(7, "t", {"metadata": _aimed("127.0.0.1")}, peer_host="")
        except BaseException as e:  # what the control session would have answered
            failed.append(e)

    t = threading.Thread(target=connect)
    t.start()
    assert loading.wait(10)
    server.session_closed(7)  # the control connection went away mid-connect
    go_on.set()
    t.join(10)
    assert len(failed) == 1 and isinstance(failed[0], RemoteProtocolError), failed
    assert "closed" in str(failed[0])
    assert server._sessions == {} and server._names == {} and server._connecting == {}
    assert server._loading == {}
