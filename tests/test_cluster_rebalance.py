"""The rebalancer's pass against a real agent as the new owner: chunks this node no longer owns
are handed over byte-exact and deleted here; a pass cut short by a newer view leaves the rest
pending and the next pass finishes (resumable); chunks it still owns stay."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import dpu_agent.cluster._rebalance as rb
from dpu_agent.cluster import Rebalancer, tenant_keys
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.service import AgentProcess, spawn_agent
from host_shim.client import KVClient
from kvproto.keys import ChunkLayout
from kvproto.placement import Node, Placement

LAYOUT = ChunkLayout("rebalance-test", "uint8", 1, 1, 1, chunk_tokens=1)


def key(i: int) -> bytes:
    return hashlib.blake2b(f"k{i}".encode(), digest_size=16).digest()


def data(i: int) -> bytes:
    return bytes([i % 251]) * (5000 + i)


@pytest.fixture()
def target(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "target", env={"DPUKV_METRICS_ENABLED": "0"})
    yield a
    a.stop()


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
    tenants = {"default": (target.token, 1)}
    r = Rebalancer(engine=engine, node="me", placement=lambda: views["v"],
                   tenants=lambda: tenants, bytes_per_s=1e9)  # fmt: skip
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
                    bytes_per_s=1e9)  # fmt: skip
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
                   tenants=dict, bytes_per_s=1000.0)  # fmt: skip
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
                   tenants=lambda: {"default": (target.token, 2)}, bytes_per_s=1e9)  # fmt: skip
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
