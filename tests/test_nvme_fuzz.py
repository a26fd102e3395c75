"""Fuzz the live target with random and mutated PDUs (bounded in count and time).

Invariant: the target never crashes or hangs; a bad connection gets a C2HTermReq or is
closed; a controller connected before the fuzzing keeps working throughout.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator

import pytest

from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeTcpController
from kvproto.nvme import (
    CapsuleCmd,
    ConnectData,
    H2CData,
    ICReq,
    connect,
    encode_pdu,
    read,
    write,
)

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:fuzz"
HOST = "nqn.2026-11.io.dpu-kvtier:host:fuzz"
CASES_MAX = 150  # connections tried
SECONDS_MAX = 20.0  # and never longer than this
ANSWER_TIMEOUT_S = 5.0  # a bad connection must be answered or closed within this


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    with TargetProcess(NQN, allow_hosts=[HOST], blocks=256, max_io_size=128 << 10) as t:
        yield t


def _valid_stream() -> list[bytes]:
    """A well-formed session: ICReq, Connect, a write with in-capsule data, an R2T write,
    a read (each PDU its own element, so mutations hit one)."""
    cd = ConnectData(hostid=bytes(16), cntlid=0xFFFF, subnqn=NQN, hostnqn=HOST).pack()
    pdus = [
        ICReq(),
        CapsuleCmd(sqe=connect(cid=1, qid=0, sqsize=31), data=cd),
        CapsuleCmd(sqe=write(cid=2, nsid=1, slba=0, nlb=1, in_capsule=True), data=b"w" * 4096),
        CapsuleCmd(sqe=write(cid=3, nsid=1, slba=1, nlb=2)),
        H2CData(cccid=3, ttag=1, datao=0, data=b"h" * 8192),
        CapsuleCmd(sqe=read(cid=4, nsid=1, slba=0, nlb=1)),
    ]
    return [b"".join(bytes(p) for p in encode_pdu(pdu)) for pdu in pdus]


def _mutate(rng: random.Random, stream: list[bytes]) -> bytes:
    parts = stream[: rng.randint(1, len(stream))]
    i = rng.randrange(len(parts))
    victim = bytearray(parts[i])
    kind = rng.randrange(4)
    if kind == 0:  # flip bytes in the header
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(min(len(victim), 72))
            victim[pos] = rng.randrange(256)
    elif kind == 1:  # truncate
        victim = victim[: rng.randrange(len(victim))]
    elif kind == 2:  # duplicate (out of order)
        parts.insert(i, bytes(victim))
    else:  # garbage after it
        victim += os.urandom(rng.randint(1, 64))
    parts[i] = bytes(victim)
    return b"".join(parts)


def _poke(port: int, payload: bytes) -> bytes:
    """Send `payload`, half-close, and read until the target closes (bounded)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    got = bytearray()
    try:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return bytes(got)  # the target closed on us mid-send: fine
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return bytes(got)
            if not chunk:
                return bytes(got)
            got += chunk
        raise AssertionError(f"target neither answered nor closed in {ANSWER_TIMEOUT_S} s")
    finally:
        s.close()


def test_fuzz_live_target(target: TargetProcess) -> None:
    rng = random.Random(0xC0FFEE)
    good = NvmeTcpController.connect("127.0.0.1", target.port, NQN, HOST, keep_alive=False)
    try:
        stream = _valid_stream()
        start, cases, term_reqs = time.monotonic(), 0, 0
        while cases < CASES_MAX and time.monotonic() - start < SECONDS_MAX:
            if cases % 3 == 0:
                payload = os.urandom(rng.randint(1, 400))
            else:
                payload = _mutate(rng, stream)
            answer = _poke(target.port, payload)
            term_reqs += b"\x03" in answer[:1] or any(
                answer[i] == 0x03 and answer[i + 2] == 24 for i in range(0, max(0, len(answer) - 3))
            )
            cases += 1
            if cases % 25 == 0:  # the good controller keeps working meanwhile
                data = os.urandom(8192)
                good.write(1, 100, data)
                out = bytearray(8192)
                good.read(1, 100, out)
                assert out == data
            assert target.alive()
        assert cases >= 20 and term_reqs > 0, (cases, term_reqs)
        good.read(1, 0, bytearray(4096))
    finally:
        good.close()


def test_out_of_order_pdu_gets_c2h_term_req(target: TargetProcess) -> None:
    capsule = b"".join(
        bytes(p) for p in encode_pdu(CapsuleCmd(sqe=read(cid=1, nsid=1, slba=0, nlb=1)))
    )
    answer = _poke(target.port, capsule)  # a command before ICReq
    assert answer[0] == 0x03 and answer[2] == 24  # C2HTermReq
    assert int.from_bytes(answer[8:10], "little") == 0x02  # FES: PDU sequence error
    assert answer[24:32] == capsule[:8]  # the offending header echoed


def test_h2c_data_for_unknown_transfer_gets_c2h_term_req(target: TargetProcess) -> None:
    stream = _valid_stream()
    bogus = b"".join(
        bytes(p) for p in encode_pdu(H2CData(cccid=9, ttag=77, datao=0, data=b"x" * 64))
    )
    with socket.create_connection(("127.0.0.1", target.port), timeout=ANSWER_TIMEOUT_S) as s:
        s.sendall(stream[0])  # ICReq; a host sends nothing else before the ICResp
        assert _recv_exact(s, 128)[0] == 0x01
        s.sendall(stream[1] + bogus)  # Connect, then data nobody asked for
        resp = _recv_exact(s, 24)
        assert resp[0] == 0x05 and int.from_bytes(resp[22:24], "little") >> 1 == 0  # Connect OK
        term = _recv_exact(s, 24)
        assert term[0] == 0x03 and int.from_bytes(term[8:10], "little") == 0x01
        assert int.from_bytes(term[10:14], "little") == 10  # FEI: the ttag field
        assert s.recv(4096)[:24] == bogus[:24] and s.recv(4096) == b""  # echoed, then closed


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)
