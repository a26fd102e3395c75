"""NVMe/TCP codec: one PDU table run whole, byte at a time and with trailing bytes; property
tests for every PDU type; the fuzz invariant; the errors the spec names (FES/FEI)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.nvme import (
    NEED_DATA,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    ConnectData,
    ConnectDataError,
    Cqe,
    DiscoveryEntry,
    DiscoveryLog,
    Fes,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    IdentifyController,
    IdentifyNamespace,
    LocalProtocolError,
    Pdu,
    QpState,
    QueuePair,
    RemoteProtocolError,
    Role,
    Sgl,
    Sqe,
    Status,
    connect,
    crc32c,
    encode_pdu,
    read,
    write,
)

SQE = write(cid=7, nsid=1, slba=1 << 40, nlb=2, in_capsule=True)
CQE = Cqe(cid=7, status=0x182 | 1 << 14, cdw0=0x2C0001, cdw1=5, sqhd=3, sqid=2)

# (pdu, receiving role): every PDU type with its data, as the peer of `role` sends it.
TABLE: list[tuple[Pdu, Role]] = [
    (CapsuleCmd(sqe=read(cid=1, nsid=1, slba=0, nlb=256)), Role.CONTROLLER),
    (CapsuleCmd(sqe=SQE, data=bytes(range(256)) * 32), Role.CONTROLLER),
    (H2CData(cccid=7, ttag=9, datao=4096, data=b"\xab" * 12288, last=True), Role.CONTROLLER),
    (H2CData(cccid=7, ttag=9, datao=0, data=b"\x01", last=False), Role.CONTROLLER),
    (H2CTermReq(fes=Fes.PDU_SEQUENCE_ERROR, fei=0, data=b"\x04" * 72), Role.CONTROLLER),
    (CapsuleResp(cqe=CQE), Role.HOST),
    (C2HData(cccid=3, datao=0, data=b"\xcd" * 40000, last=True, success=True), Role.HOST),
    (C2HData(cccid=3, datao=8, data=b"\x00" * 8, last=False), Role.HOST),
    (R2T(cccid=5, ttag=1, r2to=0, r2tl=1 << 20), Role.HOST),
    (C2HTermReq(fes=Fes.INVALID_PDU_HEADER_FIELD, fei=2, data=b""), Role.HOST),
]
DIGESTS = [(False, False, 0), (True, True, 0), (True, False, 3), (False, True, 31)]


def ready_pair(role: Role, *, hdgst: bool, ddgst: bool, pda: int) -> tuple[QueuePair, QueuePair]:
    """(receiver of `role`, its peer) after the ICReq/ICResp exchange."""
    host, ctrl = QueuePair(Role.HOST), QueuePair(Role.CONTROLLER, capsule_data_bytes_max=8192)
    ctrl.receive_data(b"".join(host.send(ICReq(hpda=pda, hdgst=hdgst, ddgst=ddgst))))
    assert isinstance(ctrl.next_event(), ICReq)
    host.receive_data(b"".join(ctrl.send(ICResp(cpda=pda, hdgst=hdgst, ddgst=ddgst))))
    assert isinstance(host.next_event(), ICResp)
    assert host.state is ctrl.state is QpState.READY
    return (host, ctrl) if role is Role.HOST else (ctrl, host)


def same(a: Pdu, b: Pdu) -> bool:
    """Equal up to the data's buffer type (bytes vs memoryview)."""
    fa = {k: getattr(a, k) for k in a.__dataclass_fields__}
    fb = {k: getattr(b, k) for k in b.__dataclass_fields__}
    if "data" in fa:
        fa["data"], fb["data"] = bytes(fa["data"]), bytes(fb["data"])
    return type(a) is type(b) and fa == fb


def events(qp: QueuePair) -> list[Pdu]:
    out = []
    while (ev := qp.next_event()) is not NEED_DATA:
        assert not isinstance(ev, type(NEED_DATA))
        out.append(ev)
    return out


@pytest.mark.parametrize(("hdgst", "ddgst", "pda"), DIGESTS)
@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("index", range(len(TABLE)))
def test_table_round_trip(index: int, how: str, hdgst: bool, ddgst: bool, pda: int) -> None:
    pdu, role = TABLE[index]
    rx, tx = ready_pair(role, hdgst=hdgst, ddgst=ddgst, pda=pda)
    wire = b"".join(tx.send(pdu))
    if how == "whole":
        rx.receive_data(wire)
    elif how == "bytewise":
        for i in range(len(wire)):
            rx.receive_data(wire[i : i + 1])
    else:  # the first bytes of a following PDU stay pending
        rx.receive_data(wire + wire[:5])
    got = events(rx)
    assert len(got) == 1 and same(got[0], pdu), (got, pdu)
    assert rx.at_pdu_boundary is (how != "trailing")


def test_digests_and_padding_on_the_wire() -> None:
    parts = encode_pdu(C2HData(cccid=1, datao=0, data=b"x" * 10), hdgst=True, ddgst=True, pda=3)
    header, data, ddgst = (bytes(p) for p in parts)
    assert header[0] == 0x07 and header[1] == 0x01 | 0x02 | 0x04  # HDGSTF DDGSTF LAST_PDU
    assert header[2] == 24 and header[3] == 32  # hlen, pdo aligned to (3 + 1) * 4 = 16
    assert int.from_bytes(header[24:28], "little") == crc32c(header[:24])
    assert int.from_bytes(ddgst, "little") == crc32c(data)
    assert int.from_bytes(header[4:8], "little") == 32 + 10 + 4
    assert crc32c(b"123456789") == 0xE3069283  # the CRC32C check value


def _wire(pdu: Pdu, **kw: object) -> bytes:
    return b"".join(encode_pdu(pdu, **kw))  # type: ignore[arg-type]


def _expect_error(role: Role, wire: bytes, fes: Fes, fei: int | None = None) -> QueuePair:
    rx, _ = ready_pair(role, hdgst=False, ddgst=False, pda=0)
    with pytest.raises(RemoteProtocolError) as err:
        rx.receive_data(wire)
    assert err.value.fes == fes, err.value
    if fei is not None:
        assert err.value.fei == fei
    assert rx.state is QpState.ERROR
    with pytest.raises(LocalProtocolError):
        rx.receive_data(b"\0")
    return rx


def test_error_after_good_pdus_is_raised_after_them() -> None:
    rx, tx = ready_pair(Role.CONTROLLER, hdgst=False, ddgst=False, pda=0)
    good = b"".join(tx.send(CapsuleCmd(sqe=SQE, data=b"d" * 64)))
    rx.receive_data(good + bytes([0x0F, 0, 24, 0, 24, 0, 0, 0]) + bytes(16) + good)
    assert isinstance(rx.next_event(), CapsuleCmd)  # answered first, in order
    assert rx.state is QpState.READY
    with pytest.raises(RemoteProtocolError) as err:
        rx.next_event()
    assert err.value.fes == Fes.INVALID_PDU_HEADER_FIELD and rx.state is QpState.ERROR


def test_unknown_pdu_type() -> None:
    _expect_error(
        Role.CONTROLLER,
        bytes([0x0F, 0, 24, 0, 24, 0, 0, 0]) + bytes(16),
        Fes.INVALID_PDU_HEADER_FIELD,
        0,
    )


def test_wrong_hlen() -> None:
    wire = bytearray(_wire(CapsuleCmd(sqe=SQE)))
    wire[2] = 70
    _expect_error(Role.CONTROLLER, bytes(wire), Fes.INVALID_PDU_HEADER_FIELD, 2)


def test_plen_too_small_for_data_pdu() -> None:
    wire = bytearray(_wire(H2CData(cccid=1, ttag=1, datao=0, data=b"abcd")))
    wire[4] = 24  # plen = hlen: no data
    _expect_error(Role.CONTROLLER, bytes(wire[:24]), Fes.INVALID_PDU_HEADER_FIELD)


def test_pdu_from_the_wrong_side_is_a_sequence_error() -> None:
    _expect_error(Role.CONTROLLER, _wire(CapsuleResp(cqe=CQE)), Fes.PDU_SEQUENCE_ERROR)
    _expect_error(Role.HOST, _wire(CapsuleCmd(sqe=SQE)), Fes.PDU_SEQUENCE_ERROR)


def test_capsule_before_icreq_is_a_sequence_error() -> None:
    ctrl = QueuePair(Role.CONTROLLER)
    with pytest.raises(RemoteProtocolError) as err:
        ctrl.receive_data(_wire(CapsuleCmd(sqe=SQE)))
    assert err.value.fes == Fes.PDU_SEQUENCE_ERROR
    # the TermReq answering it echoes the offending header
    term = b"".join(ctrl.term_req(err.value))
    assert term[0] == 0x03 and term[2] == 24 and term[24:32] == _wire(CapsuleCmd(sqe=SQE))[:8]
    assert ctrl.state is QpState.CLOSED


def test_icreq_with_unknown_pfv() -> None:
    wire = bytearray(_wire(ICReq()))
    wire[8] = 1
    ctrl = QueuePair(Role.CONTROLLER)
    with pytest.raises(RemoteProtocolError) as err:
        ctrl.receive_data(bytes(wire))
    assert (err.value.fes, err.value.fei) == (Fes.INVALID_PDU_HEADER_FIELD, 8)


def test_header_digest_mismatch() -> None:
    rx, tx = ready_pair(Role.CONTROLLER, hdgst=True, ddgst=False, pda=0)
    wire = bytearray(b"".join(tx.send(CapsuleCmd(sqe=SQE))))
    wire[72] ^= 0xFF
    with pytest.raises(RemoteProtocolError) as err:
        rx.receive_data(bytes(wire))
    assert err.value.fes == Fes.HEADER_DIGEST_ERROR


def test_data_digest_mismatch_is_reported_not_fatal() -> None:
    rx, tx = ready_pair(Role.CONTROLLER, hdgst=False, ddgst=True, pda=0)
    wire = bytearray(b"".join(tx.send(CapsuleCmd(sqe=SQE, data=b"q" * 100))))
    wire[-1] ^= 0x01
    rx.receive_data(bytes(wire))
    (ev,) = events(rx)
    assert isinstance(ev, CapsuleCmd) and not ev.ddgst_ok
    assert rx.state is QpState.READY


def test_in_capsule_data_over_the_limit() -> None:
    pdu = CapsuleCmd(sqe=SQE, data=bytes(8193))
    _expect_error(Role.CONTROLLER, _wire(pdu), Fes.DATA_TRANSFER_LIMIT_EXCEEDED, 4)


def test_host_cannot_send_before_icresp() -> None:
    host = QueuePair(Role.HOST)
    with pytest.raises(LocalProtocolError):
        host.send(CapsuleCmd(sqe=SQE))


def test_icresp_enabling_an_unrequested_digest() -> None:
    host = QueuePair(Role.HOST)
    host.send(ICReq(hdgst=False))
    with pytest.raises(RemoteProtocolError) as err:
        host.receive_data(_wire(ICResp(hdgst=True)))
    assert err.value.fes == Fes.UNSUPPORTED_PARAMETER


def test_sink_places_data_in_caller_memory() -> None:
    target = bytearray(100)

    def sink(ptype: object, cid: int, ttag: int, offset: int, length: int) -> memoryview:
        return memoryview(target)[10 : 10 + length]

    host = QueuePair(Role.HOST, sink=sink)
    host.send(ICReq())
    host.receive_data(_wire(ICResp()))
    host.next_event()
    host.receive_data(_wire(C2HData(cccid=1, datao=0, data=b"z" * 50)))
    (ev,) = events(host)
    assert isinstance(ev, C2HData) and bytes(target[10:60]) == b"z" * 50
    assert isinstance(ev.data, memoryview) and ev.data.obj is target


# -- property tests: every PDU type with arbitrary fields ---------------------------------

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
payload = st.binary(min_size=1, max_size=3000)
sqes = st.builds(
    Sqe,
    opcode=st.integers(0, 255),
    cid=u16,
    flags=st.integers(0, 255),
    nsid=u32,
    cdw2=u32,
    cdw3=u32,
    mptr=st.integers(0, (1 << 64) - 1),
    sgl=st.builds(Sgl, address=st.integers(0, (1 << 64) - 1), length=u32, type=st.integers(0, 255)),
    cdw10=u32,
    cdw11=u32,
    cdw12=u32,
    cdw13=u32,
    cdw14=u32,
    cdw15=u32,
)
cqes = st.builds(
    Cqe, cid=u16, status=st.integers(0, 0x7FFF), cdw0=u32, cdw1=u32, sqhd=u16, sqid=u16
)
to_controller = st.one_of(
    st.builds(CapsuleCmd, sqe=sqes, data=st.binary(max_size=8192)),
    st.builds(H2CData, cccid=u16, ttag=u16, datao=u32, data=payload, last=st.booleans()),
    st.builds(H2CTermReq, fes=u16, fei=u32, data=st.binary(max_size=152)),
)
to_host = st.one_of(
    st.builds(CapsuleResp, cqe=cqes),
    st.builds(
        C2HData, cccid=u16, datao=u32, data=payload, last=st.just(True), success=st.booleans()
    ),
    st.builds(C2HData, cccid=u16, datao=u32, data=payload, last=st.just(False)),
    st.builds(R2T, cccid=u16, ttag=u16, r2to=u32, r2tl=st.integers(1, 0xFFFFFFFF)),
    st.builds(C2HTermReq, fes=u16, fei=u32, data=st.binary(max_size=152)),
)
digests = st.tuples(st.booleans(), st.booleans(), st.integers(0, 31))


@settings(max_examples=150, deadline=None)
@given(pdu=st.one_of(to_controller, to_host), dg=digests, cut=st.integers(1, 97))
def test_every_pdu_round_trips(pdu: Pdu, dg: tuple[bool, bool, int], cut: int) -> None:
    role = Role.CONTROLLER if isinstance(pdu, CapsuleCmd | H2CData | H2CTermReq) else Role.HOST
    rx, tx = ready_pair(role, hdgst=dg[0], ddgst=dg[1], pda=dg[2])
    wire = b"".join(tx.send(pdu))
    for i in range(0, len(wire), cut):  # arbitrary split points
        rx.receive_data(wire[i : i + cut])
    got = events(rx)
    assert len(got) == 1 and same(got[0], pdu)


@settings(max_examples=100, deadline=None)
@given(
    ic=st.builds(
        ICReq, hpda=st.integers(0, 31), hdgst=st.booleans(), ddgst=st.booleans(), maxr2t=u32
    )
)
def test_icreq_icresp_round_trip(ic: ICReq) -> None:
    ctrl = QueuePair(Role.CONTROLLER)
    ctrl.receive_data(_wire(ic))
    assert ctrl.next_event() == ic
    resp = ICResp(cpda=ic.hpda, hdgst=ic.hdgst, ddgst=ic.ddgst, maxh2cdata=1 << 20)
    host = QueuePair(Role.HOST)
    host.send(ic)
    host.receive_data(b"".join(ctrl.send(resp)))
    assert host.next_event() == resp and host.maxh2cdata == 1 << 20


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=600), role=st.sampled_from([Role.HOST, Role.CONTROLLER]))
def test_fuzz_parses_or_raises_remote_protocol_error(blob: bytes, role: Role) -> None:
    rx, _ = ready_pair(role, hdgst=False, ddgst=False, pda=0)
    try:
        rx.receive_data(blob)
        events(rx)
    except RemoteProtocolError as e:
        assert isinstance(e.fes, Fes) and rx.state is QpState.ERROR


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(min_size=1, max_size=200))
def test_fuzz_before_icreq(blob: bytes) -> None:
    ctrl = QueuePair(Role.CONTROLLER)
    try:
        ctrl.receive_data(blob)
        events(ctrl)
    except RemoteProtocolError:
        assert ctrl.state is QpState.ERROR


# -- SQE/CQE and data structures ----------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(sqe=sqes, cqe=cqes)
def test_sqe_cqe_round_trip(sqe: Sqe, cqe: Cqe) -> None:
    assert Sqe.unpack(sqe.pack()) == sqe
    assert Cqe.unpack(cqe.pack()) == cqe


def test_cqe_status_fields() -> None:
    cqe = Cqe.error(cid=1, status=Status.CONNECT_INVALID_HOST)
    wire = cqe.pack()
    status = int.from_bytes(wire[14:16], "little")
    assert status & 1 == 0 and (status >> 1) & 0xFF == 0x84 and (status >> 9) & 7 == 1
    assert status >> 15 == 1  # DNR
    assert (cqe.sct, cqe.sc, cqe.dnr, cqe.code) == (1, 0x84, True, Status.CONNECT_INVALID_HOST)


def test_connect_command_layout() -> None:
    raw = connect(cid=3, qid=2, sqsize=127, kato_ms=15000).pack()
    assert raw[0] == 0x7F and raw[4] == 0x01  # Fabrics, fctype Connect
    assert int.from_bytes(raw[42:44], "little") == 2 and int.from_bytes(raw[44:46], "little") == 127
    assert int.from_bytes(raw[48:52], "little") == 15000
    assert raw[24 + 15] == 0x01 and int.from_bytes(raw[24 + 8 : 24 + 12], "little") == 1024


def test_connect_data_round_trip_and_errors() -> None:
    cd = ConnectData(hostid=bytes(range(16)), cntlid=0xFFFF, subnqn="nqn.a:b", hostnqn="nqn.h")
    raw = cd.pack()
    assert len(raw) == 1024 and raw[256:263] == b"nqn.a:b" and raw[512:517] == b"nqn.h"
    assert ConnectData.unpack(raw) == cd
    bad = bytearray(raw)
    bad[512:768] = b"x" * 256  # HOSTNQN without its NUL
    with pytest.raises(ConnectDataError) as err:
        ConnectData.unpack(bytes(bad))
    assert err.value.offset == 512


def test_identify_structures_round_trip() -> None:
    ic = IdentifyController(
        sn="SN1",
        mn="model",
        fr="1.0",
        mdts=8,
        cntlid=9,
        nn=32,
        oncs=0x0C,
        subnqn="nqn.x",
        ioccsz=260,
        iorcsz=1,
        msdbd=1,
        sgls=0x100001,
    )
    raw = ic.pack()
    assert len(raw) == 4096 and raw[4:7] == b"SN1" and raw[7] == 0x20  # space padded
    assert IdentifyController.unpack(raw) == ic
    ns = IdentifyNamespace(nsze=100, ncap=100, nuse=100, nmic=1, nguid=bytes(range(16)))
    assert IdentifyNamespace.unpack(ns.pack()) == ns and ns.block_size == 4096


def test_discovery_log_round_trip() -> None:
    entries = tuple(
        DiscoveryEntry(subnqn=f"nqn.s{i}", traddr="127.0.0.1", trsvcid=str(4420 + i))
        for i in range(3)
    )
    raw = DiscoveryLog(genctr=5, entries=entries).pack()
    assert len(raw) == 1024 * 4 and DiscoveryLog.record_count(raw) == (5, 3)
    assert DiscoveryLog.unpack(raw) == DiscoveryLog(genctr=5, entries=entries)
    assert raw[1024] == 3 and raw[1024 + 32 : 1024 + 36] == b"4420"  # TCP, trsvcid
