"""The rebalancer's pass against a real agent as the new owner: chunks this node no longer owns
are handed over byte-exact and deleted here; a pass cut short by a newer view leaves the rest
pending and the next pass finishes (resumable); chunks it still owns stay."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import secrets_env, write_cluster_secrets

import dpu_agent.cluster._rebalance as rb
from dpu_agent.cluster import PeerAuth, Rebalancer, free_port, open_peer, tenant_keys
from dpu_agent.cluster._peer import PEER_REFUSED
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.client import AgentUnreachable, ControlError, KVClient
from kvproto.control import (
    NEED_DATA,
    FrameDecoder,
    Reply,
    encode_reply,
    encode_request,
    parse_reply,
)
from kvproto.keys import ChunkLayout
from kvproto.placement import Node, Placement

LAYOUT = ChunkLayout("rebalance-test", "uint8", 1, 1, 1, chunk_tokens=1)


def key(i: int) -> bytes:
    return hashlib.blake2b(f"k{i}".encode(), digest_size=16).digest()


def data(i: int) -> bytes:
    return bytes([i % 251]) * (5000 + i)


@pytest.fixture()
def target(tmp_path: Path) -> Iterator[AgentProcess]:
    """A one-node cluster named "other": it holds the cluster key, as every peer must."""
    if shutil.which("serf") is None:
        pytest.skip("needs serf (apt-get install serf): peers are cluster members")
    AUTH["keys"] = write_cluster_secrets(tmp_path)
    env = {"DPUKV_METRICS_ENABLED": "0", "DPUKV_CLUSTER_ENABLED": "1",
           "DPUKV_AGENT_NODE_NAME": "other",
           "DPUKV_CLUSTER_SERF_BIND": f"127.0.0.1:{free_port()}",
           "DPUKV_CLUSTER_SERF_RPC": f"127.0.0.1:{free_port()}",
           **secrets_env(tmp_path, tmp_path / "target")}  # fmt: skip
    a = spawn_agent(tmp_path / "target", env=env)
    yield a
    a.stop()


AUTH: dict[str, tuple[bytes, ...]] = {}


def me() -> PeerAuth:
    return PeerAuth("me", AUTH["keys"])


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[Engine]:
    cfg = EngineConfig(data_dir=tmp_path / "me", dram_bytes=8 << 20, nvme_bytes=16 << 20,
                       tenants={"default": 0})  # fmt: skip
    e = Engine(cfg)
    yield e
    e.close()


def test_pass_hands_over_what_is_not_ours_resumes_and_keeps_the_rest(
    target: AgentProcess, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(40):
        engine.put_chunk("default", key(i), data(i))
    other = Node(name="other", control=target.control_url)
    views = {"v": Placement([Node(name="me"), other])}
    mine = {k for k in map(key, range(40)) if views["v"].owners(k)[0].name == "me"}
    assert 0 < len(mine) < 40
    tenants = {"default": ("", 1)}  # no token: the peer channel acts for the tenant by name
    r = Rebalancer(engine=engine, node="me", placement=lambda: views["v"],
                   tenants=lambda: tenants, bytes_per_s=1e9, peer_auth=me())  # fmt: skip
    p = r.run_pass()
    assert p.pending == 0 and p.failed == 0 and p.moved_chunks == 40 - len(mine)
    assert set(tenant_keys(engine, "default")) == mine
    # "me" leaves: everything goes; a newer view mid-pass stops it, the next pass goes on
    monkeypatch.setattr(rb, "REBALANCE_BATCH_KEYS", 4)
    calls = {"n": 0}
    leaving = Placement([Node(name="me", state="leaving"), other])
    newer = Placement([Node(name="me", state="leaving"), other, Node(name="x", state="joining")])

    def view() -> Placement:
        calls["n"] += 1
        return leaving if calls["n"] < 4 else newer

    r2 = Rebalancer(engine=engine, node="me", placement=view, tenants=lambda: tenants,
                    bytes_per_s=1e9, peer_auth=me())  # fmt: skip
    p2 = r2.run_pass()
    assert p2.pending > 0 and set(tenant_keys(engine, "default")) == mine  # cut short
    p2 = r2.run_pass()
    # drained: the owner holds everything, and the leaving node keeps its copies (reads still
    # come to it until it is gone)
    assert p2.pending == 0 and p2.kept_leaving == len(mine) and p2.dropped_chunks == 0
    assert set(tenant_keys(engine, "default")) == mine
    with KVClient(target.control_url, "default", target.token, LAYOUT, b"any-salt-1234567") as c:
        for i in range(40):
            buf = bytearray(len(data(i)))
            assert c.get_keys([key(i)], [buf], chunk_bytes=len(buf)) == 1 and bytes(buf) == data(i)
    r.stop()  # never started (run_pass only): stop() must not raise
    r2.stop()


def test_throttle_is_a_token_bucket_of_bytes_per_s(monkeypatch: pytest.MonkeyPatch) -> None:
    now = {"t": 100.0}
    monkeypatch.setattr(rb.time, "monotonic", lambda: now["t"])
    r = Rebalancer(engine=None, node="me", placement=lambda: Placement([]),
                   tenants=dict, bytes_per_s=1000.0, peer_auth=None)  # fmt: skip
    waits: list[float] = []
    monkeypatch.setattr(r._stop, "wait", lambda s: waits.append(s) or False)
    r._throttle(3000)  # nothing saved up: 3 s of budget owed
    assert waits == [pytest.approx(3.0)]
    now["t"] += 10.0  # idle time saves at most one second's worth (a 1,000-byte burst)
    r._throttle(500)
    r._throttle(500)
    assert len(waits) == 1
    r._throttle(1000)
    assert waits[-1] == pytest.approx(1.0)


def test_replicas_copied_when_owner_sets_change_then_not_checked_again(
    target: AgentProcess, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: only a chunk's first owner re-replicated, so a node joining as first owner
    of chunks held by the second never got them (R=2 silently became R=1)."""
    for i in range(20):
        engine.put_chunk("default", key(i), data(i))
    alone = Placement([Node(name="me")])
    both = Placement([Node(name="me"), Node(name="other", control=target.control_url)])
    views = {"v": alone}
    assert 0 < sum(both.owners(key(i), 2)[0].name == "other" for i in range(20)) < 20
    r = Rebalancer(engine=engine, node="me", placement=lambda: views["v"],
                   tenants=lambda: {"default": ("", 2)}, bytes_per_s=1e9,
                   peer_auth=me())  # fmt: skip
    checks: list[bytes] = []
    real = r._has
    monkeypatch.setattr(r, "_has", lambda t, tok, n, keys: checks.extend(keys) or real(
        t, tok, n, keys))  # fmt: skip
    assert r.run_pass().failed == 0 and checks == []  # alone: nothing to copy; settled
    views["v"] = both  # "other" joins: every chunk's owner set changed
    p = r.run_pass()
    assert len(checks) == 20 and p.moved_chunks == p.sent_chunks == 20 and p.failed == 0
    assert len(tenant_keys(engine, "default")) == 20  # an owner keeps its copy
    r.run_pass()  # same view, settled: nothing to check again
    assert len(checks) == 20
    with KVClient(target.control_url, "default", target.token, LAYOUT, b"any-salt-1234567") as c:
        assert all(c.lookup_keys([key(i)]) == 1 for i in range(20))


class FakePeer:
    """A control port that is not a member: answers each peer_challenge with a made-up proof
    (or with nothing) and records every frame it gets."""

    def __init__(self, answer: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = answer
        self.ops: list[str] = []
        self.received = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                dec = FrameDecoder()
                try:
                    while data := conn.recv(65536):
                        self.received += data
                        dec.receive_data(data)
                        while (msg := dec.next_message()) is not NEED_DATA:
                            self.ops.append(msg["op"])
                            if not self.answer:
                                raise ConnectionAbortedError
                            result = {"node": "other", "nonce": os.urandom(32),
                                      "proof": os.urandom(32)}  # fmt: skip
                            conn.sendall(encode_reply(Reply(id=msg["id"], ok=True, result=result)))
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("answer", [True, False], ids=["forged-proof", "silent"])
def test_peer_that_cannot_prove_membership_gets_no_token_no_chunk_and_copies_stay(
    engine: Engine, answer: bool
) -> None:
    """Regression: peers were reached with the tenant token and a local copy was deleted on
    any peer's ack; an impostor at a member's `ctl` took every chunk."""
    for i in range(10):
        engine.put_chunk("default", key(i), data(i))
    fake = FakePeer(answer)
    refused = PEER_REFUSED.labels("server_proof")
    before = refused._value.get()
    try:
        leaving = Placement(
            [Node(name="me", state="leaving"), Node(name="other", control=fake.url)]
        )
        auth = PeerAuth("me", (b"k" * 44,))
        r = Rebalancer(engine=engine, node="me", placement=lambda: leaving,
                       tenants=lambda: {"default": ("", 1)}, bytes_per_s=1e9,
                       peer_auth=auth)  # fmt: skip
        p = r.run_pass()
        r.stop()
        assert p.moved_chunks == 0 and p.failed == 10
        assert sorted(tenant_keys(engine, "default")) == sorted(map(key, range(10)))
        assert fake.ops and set(fake.ops) == {"peer_challenge"}  # never a hello, never data
        assert b"hello" not in fake.received and b"reserve" not in fake.received
        if answer:
            assert refused._value.get() > before
    finally:
        fake.close()


def test_agent_refuses_a_peer_hello_without_the_cluster_key(target: AgentProcess) -> None:
    host, port = target.control_url.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        dec = FrameDecoder()
        s.sendall(encode_request(1, "peer_challenge", node="me", nonce=os.urandom(32)))
        s.sendall(encode_request(2, "hello", version=1, tenant="default", token="",
                                 peer_proof=os.urandom(32)))  # fmt: skip
        replies: list[Reply] = []
        while len(replies) < 2:
            data = s.recv(65536)
            assert data, replies
            dec.receive_data(data)
            while (msg := dec.next_message()) is not NEED_DATA:
                replies.append(parse_reply(msg))
    assert replies[0].ok and replies[0].result["node"] == "other"
    assert not replies[1].ok and replies[1].error == "auth"
    wrong = PeerAuth("me", (b"w" * 44,))
    with pytest.raises(AgentUnreachable):
        open_peer(Node(name="other", control=target.control_url), "default", wrong)._ensure()
    right = open_peer(Node(name="other", control=target.control_url), "default", me())
    try:
        assert right.lookup_keys([key(1)]) == 0  # a session of "default", with no token
    finally:
        right.close()
    impostor = open_peer(Node(name="someone", control=target.control_url), "default", me())
    with pytest.raises(AgentUnreachable, match="did not prove"):
        impostor._ensure()  # the key is right but the name is not the member we meant


def test_a_refused_grant_sends_nothing_and_the_pass_retries(
    target: AgentProcess, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI: a joiner received 53 chunks in 9.2 s at a 16 KiB/s receive rate, 12 s of
    grants): a receiver that could not answer `cluster_grant` yet (Serf had published it before
    its rebalancer existed) was written to at the sender's rate alone. Now no grant, no write."""
    for i in range(12):
        engine.put_chunk("default", key(i), data(i))
    other = Node(name="other", control=target.control_url)
    leaving = Placement([Node(name="me", state="leaving"), other])
    r = Rebalancer(engine=engine, node="me", placement=lambda: leaving,
                   tenants=lambda: {"default": ("", 1)}, bytes_per_s=1e9,
                   peer_auth=me())  # fmt: skip
    real_peer = r._peer
    refuse = {"on": True}

    def peer(tenant: str, token: str, node: Node) -> object:
        c = real_peer(tenant, token, node)
        real_call = c.channel.call

        def call(op: str, **fields: object) -> dict[str, object]:
            if op == "cluster_grant" and refuse["on"]:  # the real agent, before it can answer
                raise ControlError("invalid", "cluster_grant: this agent is not in a cluster")
            return real_call(op, **fields)

        monkeypatch.setattr(c.channel, "call", call)
        return c

    monkeypatch.setattr(r, "_peer", peer)
    p = r.run_pass()
    assert p.moved_chunks == 0 and p.failed == 12
    with KVClient(target.control_url, "default", target.token, LAYOUT, b"any-salt-1234567") as c:
        assert c.lookup_keys([key(i) for i in range(12)]) == 0  # nothing reached it
    refuse["on"] = False
    p = r.run_pass()
    assert p.pending == 0 and p.failed == 0 and p.moved_chunks == 12
    with KVClient(target.control_url, "default", target.token, LAYOUT, b"any-salt-1234567") as c:
        assert c.lookup_keys([key(i) for i in range(12)]) == 12
    r.stop()


def test_grants_are_answered_before_membership_is_up() -> None:
    """The receive rate exists before Serf publishes the node: a grant asked in that window is
    answered from it (not refused, which made senders write at their own rate)."""
    from types import SimpleNamespace

    from dpu_agent.cluster import ReceiveLimiter, agent_cluster_op

    starting = SimpleNamespace(cluster=None, cluster_receiver=ReceiveLimiter(1000.0))
    waits = [agent_cluster_op(starting, "default", "cluster_grant", {"bytes": 1500})["wait_s"]
             for _ in range(2)]  # fmt: skip
    assert waits[1] > waits[0] >= 0.4  # one bucket, paid for by waiting
    with pytest.raises(ValueError, match="not in a cluster"):
        agent_cluster_op(SimpleNamespace(cluster=None, cluster_receiver=None), "default",
                         "cluster_grant", {"bytes": 1})  # fmt: skip
    with pytest.raises(ValueError, match="not in a cluster"):
        agent_cluster_op(starting, "default", "cluster_hot", {"keys": []})


def test_a_grant_is_a_size_in_range_and_its_answer_a_bounded_wait() -> None:
    """A peer's grant request and answer are input: a negative or huge size would hand the
    asker the receiver's rate (a negative one refills its bucket), and an answer that is not
    a number, NaN or enormous must neither raise in the pass nor park it."""
    from types import SimpleNamespace

    from dpu_agent.cluster import ReceiveLimiter, agent_cluster_op
    from dpu_agent.cluster._rebalance import GRANT_WAIT_S_MAX, grant_wait
    from kvproto.control import GRANT_BYTES_MAX

    agent = SimpleNamespace(cluster=None, cluster_receiver=ReceiveLimiter(1000.0))
    for bad in (-(10**12), 0, GRANT_BYTES_MAX + 1, "1000", 1.5, True, None):
        with pytest.raises(ValueError, match="bytes must be a whole number"):
            agent_cluster_op(agent, "default", "cluster_grant", {"bytes": bad})
    assert agent_cluster_op(agent, "default", "cluster_grant", {"bytes": 500})["wait_s"] >= 0
    assert grant_wait({"wait_s": 1.5}) == 1.5
    assert grant_wait({"wait_s": 1e18}) == GRANT_WAIT_S_MAX
    for bad_answer in ({}, {"wait_s": "soon"}, {"wait_s": float("nan")}, {"wait_s": -1}, None):
        assert grant_wait(bad_answer) is None


class _InProcessPeer:
    """Member "other" answered in-process by its own engine and rebalancer: the digest and
    the chunks it holds, as its control server would (`cluster_digest`, a get)."""

    def __init__(self, engine: Engine, rebalancer: Rebalancer) -> None:
        self.engine, self.rebalancer = engine, rebalancer
        self.channel = self

    def call(self, op: str, **fields: object) -> dict[str, object]:
        assert op == "cluster_digest", op
        return self.rebalancer.answer_digest("default", 2, dict(fields))

    def get_keys(self, keys: list[bytes], bufs: list[bytearray], chunk_bytes: int) -> int:
        (k,), (buf,) = keys, bufs
        got = self.engine.get_chunk("default", k)
        if got is None or len(got) != chunk_bytes:
            return 0
        buf[:] = got
        return 1


@pytest.mark.parametrize("pull", [True, False], ids=["after-a-kill", "clean-start"])
def test_a_node_that_lost_chunks_fetches_back_what_it_first_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pull: bool
) -> None:
    """Found by an attack pass: a member killed (its DRAM tier gone) and back before the view
    changed never fetched back the chunks it first-owns (anti-entropy skipped what the first
    owner lacks), so the other owner held the only copy and a second kill lost it. A start
    after an unclean stop now pulls them back in its first rounds; a clean start does not
    (what it lacks there it evicted)."""
    engines = {}
    for name in ("me", "other"):
        cfg = EngineConfig(data_dir=tmp_path / name, dram_bytes=8 << 20, nvme_bytes=16 << 20,
                           tenants={"default": 0})  # fmt: skip
        engines[name] = Engine(cfg)
    try:
        for i in range(40):
            engines["other"].put_chunk("default", key(i), data(i))
        both = Placement([Node(name="me", control="tcp://192.0.2.1:1"),
                          Node(name="other", control="tcp://192.0.2.2:1")])  # fmt: skip
        mine = {key(i) for i in range(40) if both.owners(key(i), 2)[0].name == "me"}
        assert 0 < len(mine) < 40
        auth = PeerAuth("me", (b"k" * 44,))
        rebalancers = {
            name: Rebalancer(
                engine=engines[name],
                node=name,
                placement=lambda: both,
                tenants=lambda: {"default": ("", 2)},
                bytes_per_s=1e9,
                peer_auth=auth,
                pull=pull and name == "me",
            )
            for name in engines
        }
        peer = _InProcessPeer(engines["other"], rebalancers["other"])
        monkeypatch.setattr(rebalancers["me"], "_peer", lambda t, tok, n: peer)
        rebalancers["other"].run_pass()
        r = rebalancers["me"]
        assert r.run_pass().failed == 0  # settled at this view: the rounds run
        stats = r.run_round()
        held = set(tenant_keys(engines["me"], "default"))
        if pull:
            assert stats["pulled"] == len(mine) and held == mine
            assert all(engines["me"].get_chunk("default", k) == data(i)
                       for i in range(40) if (k := key(i)) in mine)  # fmt: skip
            assert r.progress.pull_rounds_left == rb.PULL_ROUNDS - 1
            for _ in range(rb.PULL_ROUNDS):  # then the rounds stop pulling
                r.run_round()
            # what `members` shows of it (rebalance.pull_rounds_left, pulled)
            assert r.progress.pull_rounds_left == 0 and r.progress.pulled == len(mine)
            engines["me"].delete("default", next(iter(mine)))  # evicted, say
            assert r.run_round()["pulled"] == 0
        else:
            assert stats["pulled"] == 0 and held == set()  # a clean start's lacks: evicted
    finally:
        for e in engines.values():
            e.close()
