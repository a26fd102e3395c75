"""Hostile suite for the NVMe/TCP target: strangers cannot hold it, one host cannot pin it.

Each test attacks a target in a child process (its RSS is the target's) on loopback, bounded in
count and time, from other loopback addresses (127.0.0.2...), while a legitimate host of another
tenant (another subsystem) keeps reading byte-exact within LEGIT_LATENCY_S_MAX, and checks the
target's RSS stays within the test's stated bound. The hostile host speaks NVMe/TCP with the
codec alone (`RawQueue`), so it can do what no initiator would.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from spdk_auth_peer import write_key
from test_hostile_abuse import rss_bytes

from dpu_agent.nvmf import HostKeys
from dpu_agent.nvmf._auth import AUTH_FAILED_CLOSE_S
from dpu_agent.nvmf._host_keys import host_keys_to_dict
from dpu_agent.nvmf._keys import HostKeyIssuer
from dpu_agent.nvmf._limits import (
    AUTH_DEADLINE_S,
    HOST_BUFFER_BYTES_MAX,
    TARGET_BUFFER_BYTES_MAX,
    TENANT_BUFFER_BYTES_MAX,
    UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX,
    BufferBudget,
    SizedPool,
)
from dpu_agent.nvmf._subsystem import Subsystem
from dpu_agent.nvmf._target import (
    AUTH_DH_BURST_PER_ADDRESS_MAX,
    AUTH_DH_PER_ADDRESS_PER_S,
    HANDSHAKES_PER_ADDRESS_MAX,
)
from dpu_agent.testing import TargetProcess, spawn_agent
from host_shim.client import ControlChannel
from host_shim.nvme import NvmeStatusError, NvmeTcpController
from kvproto.nvme import (
    R2T,
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    ConnectData,
    Cqe,
    DhchapHash,
    DhchapSecret,
    H2CData,
    HostAuth,
    ICReq,
    ICResp,
    Property,
    QueuePair,
    Role,
    Status,
    TlsPsk,
)
from kvproto.nvme._auth import (
    AUTH_DATA_BYTES_MAX,
    AuthNegotiate,
    DhchapChallenge,
    DhGroup,
    auth_recv,
    auth_send,
    parse_auth_message,
)
from kvproto.nvme._commands import (
    connect,
    keep_alive,
    property_get,
    property_set,
    set_features,
    write,
)

TENANT_A = "nqn.2026-11.io.dpu-kvtier:tenant:strangers-a"  # the attacked tenant
TENANT_B = "nqn.2026-11.io.dpu-kvtier:tenant:strangers-b"  # the legitimate host's tenant
VICTIM = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"  # an issued host NQN of tenant A
LEGIT = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"  # tenant B's host
VICTIM_KEY = DhchapSecret.generate(DhchapHash.SHA256)
LEGIT_KEY = DhchapSecret.generate(DhchapHash.SHA256)
STRANGER = "127.0.0.2"  # the stranger's own address (it knows the victim's NQN, not its key)
STRANGERS = [f"127.0.0.{i}" for i in range(2, 12)]  # ten source addresses
# One 64 KiB write + read back of the legitimate host, end to end: ~1 ms idle; a stalled or
# locked-out target takes seconds or fails. 1 s leaves room for a loaded two-core box.
LEGIT_LATENCY_S_MAX = 1.0
# RSS the target may gain under the stranger attacks (controllers, sockets, handshakes held at
# their caps, allocator slack): the old target grew 1.1 MiB per bare TLS connect and ~0.1 MiB
# per unauthenticated controller.
STRANGER_RSS_GROWTH_BYTES_MAX = 64 << 20


def legit_round(ctrl: NvmeTcpController, round_: int) -> float:
    """The legitimate host writes and reads back 64 KiB byte-exact; returns the seconds."""
    t0 = time.perf_counter()
    data = os.urandom(16) * 4096
    lba = 64 + (round_ % 8) * 16
    ctrl.write(1, lba, data)
    out = bytearray(len(data))
    ctrl.read(1, lba, out)
    elapsed = time.perf_counter() - t0
    assert bytes(out) == data
    assert elapsed < LEGIT_LATENCY_S_MAX, f"legitimate round trip took {elapsed:.3f} s"
    return elapsed


def keys_file(tmp_path: Path) -> Path:
    keys = {VICTIM: HostKeys(dhchap_key=VICTIM_KEY), LEGIT: HostKeys(dhchap_key=LEGIT_KEY)}
    return write_key(
        tmp_path, "hosts.json", json.dumps({h: host_keys_to_dict(k) for h, k in keys.items()})
    )


def auth_target(tmp_path: Path, **kw: object) -> TargetProcess:
    return TargetProcess(
        TENANT_A,
        also_nqns=[TENANT_B],
        allow_hosts=[VICTIM, LEGIT],
        blocks=4096,
        host_keys_file=keys_file(tmp_path),
        require_auth=True,
        **kw,  # type: ignore[arg-type]
    )


def connect_legit(port: int, **kw: object) -> NvmeTcpController:
    return NvmeTcpController.connect(
        "127.0.0.1", port, TENANT_B, LEGIT, dhchap_key=LEGIT_KEY, timeout_s=10, **kw
    )  # type: ignore[arg-type]


class RawQueue:
    """One NVMe/TCP queue from `source`, driven with the codec alone: a hostile host."""

    def __init__(self, source: str, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((source, 0))
        self.sock.settimeout(timeout_s)
        self.sock.connect(("127.0.0.1", port))
        self.qp = QueuePair(Role.HOST)
        self._cid = 0
        self.send(ICReq(hpda=0, hdgst=False, ddgst=False, maxr2t=0))
        self._next(ICResp)

    def send(self, pdu: object) -> None:
        self.sock.sendall(b"".join(bytes(p) for p in self.qp.send(pdu)))  # type: ignore[arg-type]

    def _next(self, *kinds: type) -> object:
        while True:
            ev = self.qp.next_event()
            if isinstance(ev, kinds):
                return ev
            if type(ev).__name__ != "_Sentinel":
                continue
            n = self.sock.recv_into(self.qp.get_buffer())
            if n == 0:
                raise ConnectionError("the target closed the queue")
            self.qp.buffer_updated(n)

    def run(self, make: object, data: bytes = b"") -> tuple[Cqe | None, bytes]:
        """Send `make(cid)` (in-capsule `data`), wait for its completion and its data; the
        Cqe is None for a read completed by C2HData with SUCCESS."""
        self._cid = (self._cid + 1) % 64
        sqe = make(self._cid)  # type: ignore[operator]
        self.send(CapsuleCmd(sqe=sqe, data=data))
        got = b""
        while True:
            ev = self._next(CapsuleResp, C2HData)
            if isinstance(ev, C2HData):
                got += bytes(ev.data)
                if ev.success:
                    return None, got
                continue
            assert isinstance(ev, CapsuleResp)
            return ev.cqe, got

    def connect(self, subnqn: str, hostnqn: str, qid: int = 0, cntlid: int = 0xFFFF) -> Cqe:
        """Connect (admin, or I/O queue `qid` of controller `cntlid`); its completion, which
        must be a success for an admin queue."""
        cd = ConnectData(hostid=uuid.uuid4().bytes, cntlid=cntlid, subnqn=subnqn, hostnqn=hostnqn)
        cqe, _ = self.run(lambda c: connect(cid=c, qid=qid, sqsize=31, kato_ms=0), cd.pack())
        assert cqe is not None and (qid or cqe.ok), cqe
        return cqe

    def auth_send(self, msg: bytes) -> Cqe:
        cqe, _ = self.run(lambda c: auth_send(cid=c, length=len(msg)), msg)
        assert cqe is not None
        return cqe

    def auth_recv(self) -> bytes:
        cqe, data = self.run(lambda c: auth_recv(cid=c, length=AUTH_DATA_BYTES_MAX))
        assert cqe is None or cqe.ok, cqe
        return data

    def authenticate(self, hostnqn: str, subnqn: str, key: DhchapSecret, t_id: int = 0) -> None:
        host = HostAuth(hostnqn=hostnqn, subnqn=subnqn, key=key, t_id=t_id,
                        dhgroups=[DhGroup.FFDHE2048])  # fmt: skip
        self.auth_send(host.negotiate())
        reply = host.receive(self.auth_recv())
        assert reply is not None
        self.auth_send(reply)
        assert host.receive(self.auth_recv()) is None and host.done

    def alive(self) -> bool:
        """False once the target has closed the queue (what it sent meanwhile is dropped)."""
        try:
            while select.select([self.sock], [], [], 0)[0]:
                if not self.sock.recv(65536):
                    return False
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


# --- a stranger who knows an issued host NQN, and no key, cannot hold controllers ----------


def test_known_host_nqn_without_key_cannot_hold_controllers(tmp_path: Path) -> None:
    with auth_target(tmp_path) as tgt:
        legit = connect_legit(tgt.port)
        held: list[RawQueue] = []
        try:
            before = rss_bytes(tgt.proc.pid)
            for i in range(64):  # the old target kept every one (4,096 locked every host out)
                q = RawQueue(STRANGERS[i % 2], tgt.port)
                held.append(q)
                q.connect(TENANT_A, VICTIM)  # accepted: the newcomer is never the one refused
                if i % 16 == 0:
                    legit_round(legit, i)
            open_now = [q for q in held if q.alive()]
            print(f"known nqn: {len(open_now)} of {len(held)} unauthenticated controllers open")
            assert len(open_now) <= UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX, len(open_now)
            # the victim, from its own address, still gets in and works
            with NvmeTcpController.connect("127.0.0.1", tgt.port, TENANT_A, VICTIM,
                                           dhchap_key=VICTIM_KEY, timeout_s=10) as v:  # fmt: skip
                legit_round(v, 1)
            # refused commands are no keep-alive: the authentication deadline closes them
            deadline = time.monotonic() + AUTH_DEADLINE_S + 10
            while open_now and time.monotonic() < deadline:
                for q in open_now:
                    try:
                        q.send(CapsuleCmd(sqe=keep_alive(cid=60)))
                    except OSError:
                        pass
                legit_round(legit, 2)
                time.sleep(0.5)
                open_now = [q for q in open_now if q.alive()]
            assert not open_now, (
                f"{len(open_now)} unauthenticated controllers outlived the deadline"
            )
            grown = rss_bytes(tgt.proc.pid) - before
            assert grown < STRANGER_RSS_GROWTH_BYTES_MAX, f"target RSS grew {grown >> 20} MiB"
        finally:
            for q in held:
                q.close()
            legit.close()
        assert tgt.alive()


def test_issued_host_nqn_binds_nowhere_after_restart(tmp_path: Path) -> None:
    """A hello-issued host NQN is allowed only while a control session binds it (from that
    session's address); after a restart nothing binds it, so it opens nothing from anywhere.
    An operator-added host stays allowed from any address, as `dpuctl hosts add` says."""
    path = tmp_path / "host_keys.json"
    before = HostKeyIssuer(path, dhchap=True, psk=False)
    before.issue("a", Subsystem(nqn=TENANT_A), VICTIM)
    before.close()  # the agent's stop: the batched key file written
    after = Subsystem(nqn=TENANT_A)  # the restart: a new issuer, the same file
    HostKeyIssuer(path, dhchap=True, psk=False).bind("a", after)
    assert not after.host_allowed(VICTIM, STRANGER) and not after.host_allowed(VICTIM, "127.0.0.1")
    assert after.host_keys[VICTIM].dhchap_key is not None  # its key is kept for its next hello
    operator = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    added = HostKeyIssuer(path, dhchap=True, psk=False)
    added.issue("a", after, operator, any_address=True)
    added.close()
    again = Subsystem(nqn=TENANT_A)
    HostKeyIssuer(path, dhchap=True, psk=False).bind("a", again)
    assert again.host_allowed(operator, STRANGER) and not again.host_allowed(VICTIM, STRANGER)


def test_issued_host_nqn_opens_nothing_after_an_agent_restart(tmp_path: Path) -> None:
    """The same with a real agent: a host that said hello (and got its key) is refused after
    the agent restarts, NQN and key notwithstanding, until its client says hello again."""
    env = {"DPUKV_NVMF_REQUIRE_AUTH": "true"}
    a = spawn_agent(tmp_path / "var", env=env)
    try:
        with ControlChannel(a.control_url, "default", a.token) as ch:
            nv = ch.connect()["nvme"]
            hostnqn, key = ch.hostnqn, str(nv["dhchap_key"])
            with NvmeTcpController.connect(nv["host"], nv["port"], nv["subnqn"], hostnqn,
                                           dhchap_key=key, timeout_s=10) as c:  # fmt: skip
                assert c.active_namespaces()
    finally:
        a.stop()
    b = spawn_agent(tmp_path / "var", env=env)
    try:
        host, port = b.state["nvmf"].rsplit(":", 1)
        with pytest.raises(NvmeStatusError) as e:
            NvmeTcpController.connect(host, int(port), str(nv["subnqn"]), hostnqn,
                                      dhchap_key=key, timeout_s=10)  # fmt: skip
        assert e.value.code == Status.CONNECT_INVALID_HOST
        with ControlChannel(b.control_url, "default", b.token, hostnqn=hostnqn) as ch:
            nv = ch.connect()["nvme"]
            assert nv["dhchap_key"] == key  # the same key: it was kept, only not bound
            with NvmeTcpController.connect(nv["host"], nv["port"], nv["subnqn"], hostnqn,
                                           dhchap_key=key, timeout_s=10) as c:  # fmt: skip
                assert c.active_namespaces()
    finally:
        b.stop()


# --- bare TCP connects to a secure-channel listener cost nothing and are freed ----------------


BARE_CONNECTS = 1000  # 1.1 GiB on the old target, per round
# RSS the target may keep after the bare connects of a round are closed (the event loop's and
# the allocator's high-water marks: ~11 MiB measured), and what a second round may add to it:
# nothing per connection stays behind (the old target kept ~1 GiB per round).
TLS_RSS_AFTER_CLOSE_BYTES_MAX = 32 << 20
TLS_RSS_SECOND_ROUND_BYTES_MAX = 4 << 20


def bare_connects_round(tgt: TargetProcess, legit: NvmeTcpController, before: int) -> None:
    """BARE_CONNECTS TCP connects from ten addresses, half of them sending one byte of a TLS
    record, held while the legitimate host works, then closed."""
    bare: list[socket.socket] = []
    try:
        for i in range(BARE_CONNECTS):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((STRANGERS[i % len(STRANGERS)], 0))
            s.connect(("127.0.0.1", tgt.port))
            bare.append(s)
            if i % 100 == 0:
                legit_round(legit, i)
            if i % 2:  # half of them start a handshake: one byte of a record header
                s.send(b"\x16")
        time.sleep(1.0)  # let the target accept and read them all
        legit_round(legit, 1)
        grown = rss_bytes(tgt.proc.pid) - before
        print(f"tls: {BARE_CONNECTS} bare connects held, +{grown >> 20} MiB")
        assert grown < STRANGER_RSS_GROWTH_BYTES_MAX, f"target RSS grew {grown >> 20} MiB"
        open_now = 0
        for s in bare:
            s.setblocking(False)
            try:
                open_now += s.recv(1) != b""
            except BlockingIOError:
                open_now += 1
            except OSError:
                pass
        # at most HANDSHAKES_PER_ADDRESS_MAX per address are kept; the rest were closed
        assert open_now <= HANDSHAKES_PER_ADDRESS_MAX * len(STRANGERS), open_now
    finally:
        for s in bare:
            s.close()
    time.sleep(1.0)
    legit_round(legit, 2)


def test_bare_tls_connects_are_counted_bounded_and_freed(tmp_path: Path) -> None:
    psk = TlsPsk.generate(LEGIT, TENANT_A)
    path = write_key(tmp_path, "hosts.json", json.dumps(
        {LEGIT: host_keys_to_dict(HostKeys(dhchap_key=LEGIT_KEY, psk=psk))}))  # fmt: skip
    with TargetProcess(TENANT_A, also_nqns=[TENANT_B], allow_hosts=[LEGIT], blocks=4096,
                       host_keys_file=path, require_auth=True,
                       extra_args=["--secure-channel"]) as tgt:  # fmt: skip
        legit = connect_legit(tgt.port, psk=psk)
        try:
            legit_round(legit, 0)
            time.sleep(0.5)
            before = rss_bytes(tgt.proc.pid)
            bare_connects_round(tgt, legit, before)
            kept = rss_bytes(tgt.proc.pid) - before
            print(f"tls: after close +{kept >> 20} MiB")
            assert kept < TLS_RSS_AFTER_CLOSE_BYTES_MAX, f"{kept >> 20} MiB not freed after close"
            bare_connects_round(tgt, legit, before)
            again = rss_bytes(tgt.proc.pid) - before
            print(f"tls: after a second round +{again >> 20} MiB")
            assert again - kept < TLS_RSS_SECOND_ROUND_BYTES_MAX, f"+{again >> 20} MiB kept"
        finally:
            legit.close()
        assert tgt.alive()


# --- one host's many controllers cannot pin R2T buffers beyond its budget -------------------


# What the hostile host may send at most (bounded test): the old target pinned all of it.
HOSTILE_SEND_BYTES_MAX = 800 << 20
HOSTILE_SEND_S = 6.0
# RSS the target may gain: the host's buffer budget plus allocator and socket slack.
R2T_RSS_GROWTH_BYTES_MAX = HOST_BUFFER_BYTES_MAX + (64 << 20)


def test_many_controllers_of_one_host_cannot_pin_r2t_buffers(tmp_path: Path) -> None:
    # a file-backed namespace: writes go through the target's buffers
    with TargetProcess(TENANT_A, also_nqns=[TENANT_B], allow_hosts=[VICTIM, LEGIT],
                       max_io_size=4 << 20, file=tmp_path / "ns.img",
                       blocks=16384) as tgt:  # fmt: skip
        legit = NvmeTcpController.connect("127.0.0.1", tgt.port, TENANT_B, LEGIT, timeout_s=10)
        hostile: list[NvmeTcpController] = []
        try:
            before = rss_bytes(tgt.proc.pid)
            for _ in range(40):  # refused beyond CONTROLLERS_PER_HOST_MAX: that is fine too
                try:
                    hostile.append(NvmeTcpController.connect(
                        "127.0.0.1", tgt.port, TENANT_A, VICTIM, io_queues=2, queue_depth=16,
                        timeout_s=10))  # fmt: skip
                except Exception:
                    break
            assert hostile
            queues = [q for c in hostile for q in c._io]
            for q in queues:  # 8 x 4 MiB writes per queue, each R2T answered but its last 4 KiB
                for i in range(8):
                    sqe = write(cid=200 + i, nsid=1, slba=1024 * i, nlb=1024)
                    q._send(q._qp.send(CapsuleCmd(sqe=sqe)))
            sent = answer_r2ts_but_the_last_block(queues)
            legit_round(legit, 0)
            grown = rss_bytes(tgt.proc.pid) - before
            print(f"r2t: {len(hostile)} controllers, {sent >> 20} MiB sent, +{grown >> 20} MiB")
            assert grown < R2T_RSS_GROWTH_BYTES_MAX, (
                f"target RSS grew {grown >> 20} MiB ({sent >> 20} MiB sent)"
            )
            for r in range(5):
                legit_round(legit, r)
        finally:
            for c in hostile:
                c.close()
            legit.close()
        assert tgt.alive()


def test_one_hosts_controllers_share_its_buffer_budget() -> None:
    """40 controllers of one host together hold at most HOST_BUFFER_BYTES_MAX; another host
    of the same tenant still gets buffers; a queue waiting at the host's level is woken when
    another controller of that host gives bytes back."""
    target = BufferBudget(TARGET_BUFFER_BYTES_MAX)
    tenant = BufferBudget(TENANT_BUFFER_BYTES_MAX, target)
    host = BufferBudget(HOST_BUFFER_BYTES_MAX, tenant)
    pools = [SizedPool(4 << 20, 8) for _ in range(40)]
    for p in pools:
        p.attach(BufferBudget(parent=host))  # one controller each
    taken = {p: [b for _ in range(8) if (b := p.take(4 << 20)) is not None] for p in pools}
    held = sum(len(b) for bufs in taken.values() for b in bufs)
    assert held == host.used == tenant.used == target.used <= HOST_BUFFER_BYTES_MAX
    other = SizedPool(4 << 20, 8)
    other.attach(BufferBudget(parent=BufferBudget(HOST_BUFFER_BYTES_MAX, tenant)))
    assert other.take(4 << 20) is not None  # the tenant and the target have room
    waiting = pools[-1]
    assert not taken[waiting] and not waiting.can_take(4 << 20)
    woken: list[int] = []
    waiting.wait(lambda: woken.append(1), 4 << 20)
    full = next(p for p in pools if taken[p])
    full.close(taken[full])  # that controller goes: its bytes come back to the host
    assert woken and waiting.can_take(4 << 20)


def answer_r2ts_but_the_last_block(queues: list) -> int:  # type: ignore[type-arg]
    """For every R2T the target sends, send all of its data but the last 4 KiB (the buffer
    is then resident and pinned); bounded in bytes and time. Returns the bytes sent."""
    sent = 0
    deadline = time.monotonic() + HOSTILE_SEND_S
    for q in queues:
        q._sock.setblocking(False)
    while time.monotonic() < deadline and sent < HOSTILE_SEND_BYTES_MAX:
        readable, _, _ = select.select([q._sock for q in queues], [], [], 0.2)
        for q in [q for q in queues if q._sock in readable]:
            try:
                n = q._sock.recv_into(q._qp.get_buffer())
            except BlockingIOError:
                continue
            if not n:
                queues.remove(q)
                continue
            q._qp.buffer_updated(n)
            while isinstance(ev := q._qp.next_event(), R2T):
                data = bytes(ev.r2tl - 4096)
                pdu = H2CData(cccid=ev.cccid, ttag=ev.ttag, datao=0, data=data, last=False)
                q._sock.setblocking(True)
                q._sock.sendall(b"".join(bytes(p) for p in q._qp.send(pdu)))
                q._sock.setblocking(False)
                sent += len(data)
    for q in queues:
        q._sock.setblocking(True)
    return sent


# --- a stranger cannot hold the I/O queues of another host's controller --------------------


def test_a_stranger_cannot_hold_the_io_queues_of_another_hosts_controller(
    tmp_path: Path,
) -> None:
    """cntlids are sequential and NQNs no secret: the old target let a stranger without the
    key connect I/O queues to the victim's authenticated controller, which took their qids and
    made the victim's Set Features (Number of Queues) a Command Sequence Error (the real
    initiator failed 5 of 5 connects beside a stranger spinning Connects)."""
    with auth_target(tmp_path) as tgt:
        victim = RawQueue("127.0.0.1", tgt.port)
        held: list[RawQueue] = [victim]
        try:
            cntlid = victim.connect(TENANT_A, VICTIM).cdw0 & 0xFFFF
            victim.authenticate(VICTIM, TENANT_A, VICTIM_KEY)
            cqe, _ = victim.run(lambda c: property_set(cid=c, prop=Property.CC, value=0x460001))
            assert cqe is not None and cqe.ok, cqe
            # from another address: refused outright
            far = RawQueue(STRANGER, tgt.port)
            held.append(far)
            cqe = far.connect(TENANT_A, VICTIM, qid=1, cntlid=cntlid)
            assert (cqe.sct, cqe.sc) == (1, 0x82), cqe  # Connect Invalid Parameters
            # from the victim's own address (a NAT, another process): taken as a queue that
            # must authenticate, which holds no qid and counts for nothing until it does
            near = RawQueue("127.0.0.1", tgt.port)
            held.append(near)
            cqe = near.connect(TENANT_A, VICTIM, qid=1, cntlid=cntlid)
            assert cqe.ok and cqe.cdw0 >> 17 & 1, cqe  # accepted, authentication required
            cqe, _ = victim.run(lambda c: set_features(cid=c, fid=0x07, cdw11=3 | 3 << 16))
            assert cqe is not None and cqe.ok, cqe  # Number of Queues: still the host's call
            mine = RawQueue("127.0.0.1", tgt.port)
            held.append(mine)
            assert mine.connect(TENANT_A, VICTIM, qid=1, cntlid=cntlid).ok
            mine.authenticate(VICTIM, TENANT_A, VICTIM_KEY)
            data = os.urandom(4096)
            cqe, _ = mine.run(lambda c: write(cid=c, nsid=1, slba=8, nlb=1, in_capsule=True), data)
            assert cqe is not None and cqe.ok, cqe
            # the victim's qid 1 is held now: another Connect for it is refused
            again = RawQueue("127.0.0.1", tgt.port)
            held.append(again)
            cqe = again.connect(TENANT_A, VICTIM, qid=1, cntlid=cntlid)
            assert (cqe.sct, cqe.sc) == (1, 0x82), cqe
            # and Number of Queues is fixed once a queue proved the key (as SPDK)
            cqe, _ = victim.run(lambda c: set_features(cid=c, fid=0x07, cdw11=3 | 3 << 16))
            assert cqe is not None and (cqe.sct, cqe.sc) == (0, 0x0C), cqe
        finally:
            for q in held:
                q.close()
        assert tgt.alive()


def test_an_auth_message_too_long_for_the_hosts_buffer_ends_the_queue(tmp_path: Path) -> None:
    """A Receive whose allocation length cannot hold the message: the transaction is lost, so
    the queue goes after AUTH_FAILED_CLOSE_S (it stayed open, refusing everything, for good)."""
    with auth_target(tmp_path) as tgt:
        q = RawQueue("127.0.0.1", tgt.port)
        try:
            q.connect(TENANT_A, VICTIM)
            host = HostAuth(hostnqn=VICTIM, subnqn=TENANT_A, key=VICTIM_KEY, t_id=0,
                            dhgroups=[DhGroup.NULL])  # fmt: skip
            q.auth_send(host.negotiate())
            cqe, _ = q.run(lambda c: auth_recv(cid=c, length=4))
            assert cqe is not None and (cqe.sct, cqe.sc) == (0, 0x02), cqe  # Invalid Field
            deadline = time.monotonic() + AUTH_FAILED_CLOSE_S + 5
            while q.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not q.alive()
        finally:
            q.close()
        assert tgt.alive()


# --- a failed re-authentication ends the queue even if AUTH_Failure1 is never read ----------


def test_failed_reauthentication_with_unread_failure1_leaves_no_usable_queue(
    tmp_path: Path,
) -> None:
    with auth_target(tmp_path) as tgt:
        legit = connect_legit(tgt.port)
        q = RawQueue("127.0.0.1", tgt.port)
        try:
            before = rss_bytes(tgt.proc.pid)
            q.connect(TENANT_A, VICTIM)
            q.authenticate(VICTIM, TENANT_A, VICTIM_KEY)
            cqe, _ = q.run(lambda c: property_get(cid=c, prop=Property.CAP))
            assert cqe is not None and cqe.ok, cqe  # authenticated: the queue works
            # re-authenticate with a key that is not the host's; never read AUTH_Failure1
            wrong = HostAuth(hostnqn=VICTIM, subnqn=TENANT_A, key=LEGIT_KEY, t_id=1,
                             dhgroups=[DhGroup.NULL])  # fmt: skip
            q.auth_send(wrong.negotiate())
            reply = wrong.receive(q.auth_recv())
            assert reply is not None
            q.auth_send(reply)  # the target fails it: AUTH_Failure1 waits for a Receive
            legit_round(legit, 0)
            cqe, _ = q.run(lambda c: property_get(cid=c, prop=Property.CAP))
            assert cqe is not None and (cqe.sct, cqe.sc) == (1, 0x91), cqe  # Auth. Required
            grown = rss_bytes(tgt.proc.pid) - before
            assert grown < STRANGER_RSS_GROWTH_BYTES_MAX
        finally:
            q.close()
            legit.close()
        assert tgt.alive()


# --- strangers' DH work is off the loop and rate-limited per address ----------------------


DH_FLOOD_S = 20.0  # the stranger's flood, bounded in time ...
DH_FLOOD_ATTEMPTS_MAX = 600  # ... and in count
DH_FLOOD_THREADS = 4  # connections in flight at once, all from STRANGER


def dh_flood(port: int, deadline: float, counts: dict[str, int], lock: threading.Lock) -> None:
    """Negotiate ffdhe8192 and ask for the Challenge (the target makes a DH key for it), on
    a new queue each time; count what came back."""
    while time.monotonic() < deadline:
        with lock:
            if counts["attempts"] >= DH_FLOOD_ATTEMPTS_MAX:
                return
            counts["attempts"] += 1
            t_id = counts["attempts"] & 0xFFFF
        q = RawQueue(STRANGER, port)
        try:
            q.connect(TENANT_A, VICTIM)
            only_8192 = (int(DhGroup.FFDHE8192),)
            q.auth_send(AuthNegotiate(t_id=t_id, hash_ids=(1,), dhgroup_ids=only_8192).pack())
            got = parse_auth_message(q.auth_recv())
            with lock:
                counts["challenges" if isinstance(got, DhchapChallenge) else "refused"] += 1
        finally:
            q.close()


def test_dh_flood_from_a_stranger_is_rate_limited_and_spares_the_loop(tmp_path: Path) -> None:
    with auth_target(tmp_path) as tgt:
        legit = connect_legit(tgt.port)
        try:
            before = rss_bytes(tgt.proc.pid)
            counts = {"attempts": 0, "challenges": 0, "refused": 0}
            lock = threading.Lock()
            t0 = time.monotonic()
            flood = [
                threading.Thread(target=dh_flood, args=(tgt.port, t0 + DH_FLOOD_S, counts, lock))
                for _ in range(DH_FLOOD_THREADS)
            ]
            for t in flood:
                t.start()
            latencies = []
            while any(t.is_alive() for t in flood):
                latencies.append(legit_round(legit, len(latencies)))
                time.sleep(0.05)
            for t in flood:
                t.join()
            elapsed = time.monotonic() - t0
            # each Challenge takes one DH step of the address's budget
            allowed = AUTH_DH_BURST_PER_ADDRESS_MAX + AUTH_DH_PER_ADDRESS_PER_S * elapsed
            assert counts["attempts"] > allowed + 10, f"flood too slow to test the limit {counts}"
            print(f"dh flood: {counts} in {elapsed:.1f} s, legit max {max(latencies):.3f} s")
            assert counts["challenges"] <= allowed + 1, (counts, elapsed)
            assert counts["challenges"] + counts["refused"] == counts["attempts"]
            assert latencies and max(latencies) < LEGIT_LATENCY_S_MAX
            grown = rss_bytes(tgt.proc.pid) - before
            assert grown < STRANGER_RSS_GROWTH_BYTES_MAX, f"target RSS grew {grown >> 20} MiB"
        finally:
            legit.close()
        assert tgt.alive()


@pytest.mark.parametrize("group", [DhGroup.FFDHE2048, DhGroup.FFDHE8192])
def test_dh_values_interoperate_with_openssl(group: DhGroup) -> None:
    """Our libcrypto DH (GIL released) agrees with the `cryptography` package's."""
    import warnings

    from kvproto.nvme._auth import DhKey
    from kvproto.nvme._ffdhe import FFDHE_PRIMES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cryptography.hazmat.primitives.asymmetric import dh

        p = FFDHE_PRIMES[group.bits]
        params = dh.DHParameterNumbers(p, 2).parameters()
        theirs = params.generate_private_key()
        ours = DhKey(group)
        size = group.bits // 8
        their_y = theirs.public_key().public_numbers().y.to_bytes(size, "big")
        our_y = dh.DHPublicNumbers(int.from_bytes(ours.public_bytes(), "big"),
                                   params.parameter_numbers()).public_key()  # fmt: skip
        assert ours.shared_secret(their_y) == theirs.exchange(our_y).rjust(size, b"\0")
