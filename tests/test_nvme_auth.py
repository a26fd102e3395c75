"""DH-HMAC-CHAP codec and state machines (sans-I/O): table, fuzz invariant, host <-> controller."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.nvme import (
    AUTH_DATA_BYTES_MAX,
    CONTROLLER_TRANSITIONS,
    AuthError,
    AuthFailure,
    AuthFailureReason,
    AuthMessageError,
    AuthNegotiate,
    ControllerAuth,
    ControllerAuthState,
    DhchapChallenge,
    DhchapHash,
    DhchapReply,
    DhchapSecret,
    DhchapSuccess1,
    DhchapSuccess2,
    DhGroup,
    FabricsType,
    HostAuth,
    Sqe,
    auth_command_ok,
    auth_recv,
    auth_send,
    parse_auth_message,
)
from kvproto.nvme._ffdhe import FFDHE_PRIMES

H, S = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001", "nqn.x:sub"

TABLE = [
    (AuthNegotiate(t_id=7, hash_ids=(1, 2, 3), dhgroup_ids=(0, 1, 5)), 72),
    (DhchapChallenge(t_id=7, hash_id=1, dhgroup_id=0, seqnum=9, cval=b"c" * 32), 48),
    (
        DhchapChallenge(t_id=7, hash_id=2, dhgroup_id=1, seqnum=9, cval=b"c" * 48, dhv=b"v" * 256),
        320,
    ),
    (DhchapReply(t_id=7, rval=b"r" * 32, cval=bytes(32), cvalid=False, seqnum=0), 80),
    (
        DhchapReply(t_id=7, rval=b"r" * 64, cval=b"c" * 64, cvalid=True, seqnum=5, dhv=b"v" * 1024),
        1168,
    ),
    (DhchapSuccess1(t_id=7, hl=32), 16),
    (DhchapSuccess1(t_id=7, hl=48, rval=b"r" * 48), 64),
    (DhchapSuccess2(t_id=7), 16),
    (AuthFailure(t_id=7, reason=AuthFailureReason.FAILED, from_controller=True), 8),
    (AuthFailure(t_id=7, reason=AuthFailureReason.HASH_UNUSABLE, from_controller=False), 8),
]


@pytest.mark.parametrize(("msg", "size"), TABLE)
def test_table_pack_parse(msg: object, size: int) -> None:
    wire = msg.pack()  # type: ignore[attr-defined]
    assert len(wire) == size
    assert parse_auth_message(wire) == msg  # whole
    assert (
        parse_auth_message(bytearray(wire)) == msg and parse_auth_message(memoryview(wire)) == msg
    )


@pytest.mark.parametrize(("msg", "size"), TABLE)
def test_table_every_truncation_is_refused(msg: object, size: int) -> None:
    wire = msg.pack()  # type: ignore[attr-defined]
    for n in range(size):  # byte at a time: every prefix is an error, never a wrong message
        with pytest.raises(AuthMessageError):
            parse_auth_message(wire[:n])


@pytest.mark.parametrize(
    ("msg", "size"), [t for t in TABLE if isinstance(t[0], (AuthNegotiate, DhchapReply))]
)
def test_table_trailing_bytes_refused_where_length_is_exact(msg: object, size: int) -> None:
    with pytest.raises(AuthMessageError):
        parse_auth_message(msg.pack() + b"\0")  # type: ignore[attr-defined]


def test_wire_layout_matches_spdk_structs() -> None:
    # spdk_nvmf_dhchap_challenge: type, id, rsvd[2], t_id, hl, rsvd, hash_id, dhg_id, dhvlen, seqnum
    wire = DhchapChallenge(
        t_id=0x0102, hash_id=3, dhgroup_id=5, seqnum=0x0A0B0C0D, cval=b"c" * 64, dhv=b"v" * 3
    ).pack()
    assert wire[:16] == bytes([1, 1, 0, 0, 2, 1, 64, 0, 3, 5, 3, 0, 0x0D, 0x0C, 0x0B, 0x0A])
    neg = AuthNegotiate(t_id=1, hash_ids=(1,), dhgroup_ids=(0, 1)).pack()
    assert neg[:12] == bytes([0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 1, 2])  # sc_c 0, napd 1, desc


def test_auth_commands() -> None:
    send = Sqe.unpack(auth_send(cid=3, length=72).pack())
    assert send.fctype == FabricsType.AUTH_SEND and send.cdw11 == 72 and auth_command_ok(send)
    assert send.cdw10 == 0xE9010100
    recv = Sqe.unpack(auth_recv(cid=4).pack())
    assert recv.fctype == FabricsType.AUTH_RECV and recv.cdw11 == AUTH_DATA_BYTES_MAX
    bad = Sqe(opcode=0x7F, cid=1, nsid=FabricsType.AUTH_SEND, cdw10=0xE8010100, cdw11=8)
    assert not auth_command_ok(bad)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_parse_raises_only_auth_message_error(data: bytes) -> None:
    try:
        parse_auth_message(data)
    except AuthMessageError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=120), max_size=4))
def test_fuzz_controller_never_raises_and_never_authenticates(sends: list[bytes]) -> None:
    c = ControllerAuth(hostnqn=H, subnqn=S, key=DhchapSecret.generate(), dhgroups=[DhGroup.NULL])
    for data in sends:
        c.send(data)
        parse_auth_message(c.receive())  # always a well-formed message back
    assert not c.authenticated


def _run(host: HostAuth, ctrl: ControllerAuth) -> None:
    ctrl.send(host.negotiate())
    out = host.receive(ctrl.receive())
    assert out is not None
    ctrl.send(out)
    out = host.receive(ctrl.receive())
    if out is not None:
        ctrl.send(out)


@pytest.mark.parametrize("h", [DhchapHash.SHA256, DhchapHash.SHA384, DhchapHash.SHA512])
@pytest.mark.parametrize(
    "g", [DhGroup.NULL, DhGroup.FFDHE2048, DhGroup.FFDHE4096, DhGroup.FFDHE8192]
)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_host_and_controller_agree(h: DhchapHash, g: DhGroup, bidirectional: bool) -> None:
    key, ckey = DhchapSecret.generate(DhchapHash.SHA256), DhchapSecret.generate(DhchapHash.SHA512)
    host = HostAuth(
        hostnqn=H,
        subnqn=S,
        key=key,
        ctrl_key=ckey if bidirectional else None,
        hashes=[h],
        dhgroups=[g],
        t_id=3,
    )
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=key, ctrl_key=ckey)
    _run(host, ctrl)
    assert host.done and ctrl.authenticated and ctrl.state is ControllerAuthState.COMPLETED
    assert (ctrl.hash, ctrl.dhgroup) == (h, g)


def test_controller_picks_the_strongest_common_hash_and_group() -> None:
    ctrl = ControllerAuth(
        hostnqn=H,
        subnqn=S,
        key=None,
        hashes=[DhchapHash.SHA256, DhchapHash.SHA384],
        dhgroups=[DhGroup.NULL, DhGroup.FFDHE3072],
    )
    ctrl.send(AuthNegotiate(t_id=1, hash_ids=(1, 2, 3), dhgroup_ids=(0, 1, 2, 5)).pack())
    assert (ctrl.hash, ctrl.dhgroup) == (DhchapHash.SHA384, DhGroup.FFDHE3072)


def test_wrong_host_key_is_refused_with_authentication_failed() -> None:
    host = HostAuth(hostnqn=H, subnqn=S, key=DhchapSecret.generate(), t_id=1)
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=DhchapSecret.generate())
    with pytest.raises(AuthError) as e:
        _run(host, ctrl)
    assert e.value.reason is AuthFailureReason.FAILED and not ctrl.authenticated
    assert ctrl.state is ControllerAuthState.ERROR


def test_host_without_a_key_on_the_controller_is_refused() -> None:
    host = HostAuth(hostnqn=H, subnqn=S, key=DhchapSecret.generate(), t_id=1)
    with pytest.raises(AuthError):
        _run(host, ControllerAuth(hostnqn=H, subnqn=S, key=None))


def test_same_secret_other_nqn_is_refused() -> None:
    key = DhchapSecret.generate(DhchapHash.SHA256)  # transformed with the host NQN
    host = HostAuth(hostnqn=H + "0", subnqn=S, key=key, t_id=1)
    with pytest.raises(AuthError):
        _run(host, ControllerAuth(hostnqn=H, subnqn=S, key=key))


def test_wrong_controller_key_is_refused_by_the_host_with_failure2() -> None:
    key = DhchapSecret.generate()
    host = HostAuth(hostnqn=H, subnqn=S, key=key, ctrl_key=DhchapSecret.generate(), t_id=1)
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=key, ctrl_key=DhchapSecret.generate())
    with pytest.raises(AuthError) as e:
        _run(host, ctrl)
    assert e.value.failure2 is not None
    ctrl.send(e.value.failure2)
    assert ctrl.state is ControllerAuthState.ERROR and not ctrl.authenticated


def test_reauthentication_on_the_same_queue() -> None:
    key = DhchapSecret.generate()
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=key)
    for t_id in (1, 2, 3):
        _run(HostAuth(hostnqn=H, subnqn=S, key=key, t_id=t_id), ctrl)
    assert ctrl.transactions == 3 and ctrl.authenticated


def test_out_of_order_message_is_an_incorrect_protocol_message() -> None:
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=DhchapSecret.generate())
    ctrl.send(DhchapSuccess2(t_id=1).pack())
    f = parse_auth_message(ctrl.receive())
    assert isinstance(f, AuthFailure) and f.reason == AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE
    assert (ControllerAuthState.NEGOTIATE, DhchapSuccess2) not in CONTROLLER_TRANSITIONS


def test_transaction_id_mismatch_in_reply() -> None:
    key = DhchapSecret.generate()
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=key)
    host = HostAuth(hostnqn=H, subnqn=S, key=key, t_id=5)
    ctrl.send(host.negotiate())
    reply = parse_auth_message(host.receive(ctrl.receive()) or b"")
    assert isinstance(reply, DhchapReply)
    ctrl.send(DhchapReply(t_id=6, rval=reply.rval, cval=reply.cval, cvalid=False, seqnum=0).pack())
    assert ctrl.state is ControllerAuthState.FAILURE1


def test_bad_dh_public_value_refused() -> None:
    key = DhchapSecret.generate()
    ctrl = ControllerAuth(hostnqn=H, subnqn=S, key=key, dhgroups=[DhGroup.FFDHE2048])
    host = HostAuth(hostnqn=H, subnqn=S, key=key, t_id=5, dhgroups=[DhGroup.FFDHE2048])
    ctrl.send(host.negotiate())
    reply = parse_auth_message(host.receive(ctrl.receive()) or b"")
    assert isinstance(reply, DhchapReply)
    ctrl.send(
        DhchapReply(
            t_id=5, rval=reply.rval, cval=reply.cval, cvalid=False, seqnum=0, dhv=b"\x01"
        ).pack()
    )
    assert ctrl.state is ControllerAuthState.FAILURE1


@pytest.mark.skipif(not shutil.which("openssl"), reason="no openssl command line tool")
@pytest.mark.parametrize("bits", sorted(FFDHE_PRIMES))
def test_ffdhe_primes_match_openssl(bits: int, tmp_path: Path) -> None:
    pem = tmp_path / "p.pem"
    subprocess.run(
        [
            "openssl",
            "genpkey",
            "-genparam",
            "-algorithm",
            "DH",
            "-pkeyopt",
            f"group:ffdhe{bits}",
            "-out",
            str(pem),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FFDH deprecation notice of cryptography
        from cryptography.hazmat.primitives.serialization import load_pem_parameters

        params = load_pem_parameters(pem.read_bytes())
        numbers = params.parameter_numbers()  # type: ignore[union-attr]
    assert (numbers.p, numbers.g) == (FFDHE_PRIMES[bits], 2)
