"""One tier across real agents: each with its own real Serf agent on loopback ports, real
NVMe/TCP and encryption; a cluster KVClient (ClusterRouter) routes by rendezvous placement."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster

from host_shim import KVClient
from host_shim.cluster import ClusterRouter
from kvproto.keys import ChunkLayout

pytestmark = [
    pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary"),
    pytest.mark.timeout(240),
]

LAYOUT = ChunkLayout("cluster-test", "float16", 1, 1, 64, chunk_tokens=16)  # 2 KiB chunks
SALT = b"cluster-salt-0123456789"
PROMPTS = 24  # one chunk each: independent keys, spread over the owners


def prompt(i: int) -> np.ndarray:
    return np.arange(LAYOUT.chunk_tokens, dtype=np.uint32) + 1_000_000 * (i + 1)


def chunk(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)


def client(c: Cluster) -> KVClient:
    # a generous per-node deadline: these tests are about placement, not failure cost, and
    # the box running them is loaded (test_cluster_failures.py checks the default deadline)
    return KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1, timeout_s=3.0,
                    node_deadline_s=3.0)  # fmt: skip


def router(kv: KVClient) -> ClusterRouter:
    assert kv.router is not None
    return kv.router


def owner_of(kv: KVClient, i: int) -> list[str]:
    r = router(kv)
    return [n.name for n in r.placement.owners(kv.keys(prompt(i))[0], r.replicas)]


def held_by(c: Cluster, name: str, kv: KVClient) -> set[int]:
    """Which prompts' chunks node `name` holds (asked directly, no routing)."""
    a = c.nodes[name].agent
    with KVClient(a.control_url, "default", c.token, LAYOUT, SALT, io_queues=1) as one:
        return {i for i in range(PROMPTS) if one.lookup(prompt(i)) == 1}


@pytest.fixture()
def cluster3(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path, replicas=request.param)
    try:
        for name in ("n1", "n2", "n3"):
            c.start(name)
        c.wait_serving(["n1", "n2", "n3"], on=["n1", "n2", "n3"])
        yield c
    finally:
        c.stop_all()


@pytest.mark.parametrize("cluster3", [1], indirect=True)
def test_r1_puts_land_on_owners_and_kill9_misses_only_that_nodes_chunks(cluster3: Cluster) -> None:
    c = cluster3
    with client(c) as kv:
        assert (
            router(kv).refresh()
            and len(router(kv).placement.serving) == 3
            and router(kv).replicas == 1
        )
        for i in range(PROMPTS):
            assert kv.put(prompt(i), [chunk(i)]) == 1
        owners = {i: owner_of(kv, i)[0] for i in range(PROMPTS)}
        for name in ("n1", "n2", "n3"):
            assert held_by(c, name, kv) == {i for i, o in owners.items() if o == name}
        assert len(set(owners.values())) == 3  # 24 keys over 3 nodes: all get some
        out = [np.empty(LAYOUT.chunk_shape, np.float16)]
        for i in range(PROMPTS):
            assert kv.get(prompt(i), out) == 1 and out[0].tobytes() == chunk(i).tobytes()
        # a two-chunk prompt across owners keeps prefix semantics
        two = np.concatenate([prompt(0), prompt(1)])
        assert kv.put(two, [chunk(0), chunk(1)]) == 2 and kv.lookup(two) == 2
        # a hot prefix: read often (past its owner's 20 reads a second), its owner copies it to
        # the other nodes and marks it hot, and the client reads it from any copy
        hot = next(i for i, o in owners.items() if o == "n2")
        for _ in range(60):
            assert kv.get(prompt(hot), out) == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            hot in held_by(c, n, kv) for n in ("n1", "n3")
        ):
            time.sleep(0.1)
        assert all(hot in held_by(c, n, kv) for n in ("n1", "n3"))
        c.nodes["n2"].agent.kill()
        hits = {i for i in range(PROMPTS) if kv.get(prompt(i), out) == 1}
        assert hits == {i for i, o in owners.items() if o != "n2"} | {hot}
        assert kv.get(prompt(hot), out) == 1 and out[0].tobytes() == chunk(hot).tobytes()


@pytest.mark.parametrize("cluster3", [2], indirect=True)
def test_r2_kill9_every_chunk_still_served_byte_exact(cluster3: Cluster) -> None:
    c = cluster3
    with client(c) as kv:
        assert router(kv).refresh() and router(kv).replicas == 2
        assert all(kv.put(prompt(i), [chunk(i)]) == 1 for i in range(PROMPTS))
        for name in ("n1", "n2", "n3"):  # each chunk on both of its owners
            want = {i for i in range(PROMPTS) if name in owner_of(kv, i)}
            assert held_by(c, name, kv) == want
        c.nodes["n1"].agent.kill()
        out = [np.empty(LAYOUT.chunk_shape, np.float16)]
        for i in range(PROMPTS):
            assert kv.get(prompt(i), out) == 1, i
            assert out[0].tobytes() == chunk(i).tobytes()
        assert kv.lookup(prompt(3)) == 1


def _rebalanced(c: Cluster, names: list[str]) -> bool:
    """Every node's last rebalance pass ran at the current epoch and left nothing pending."""
    views = [c.members(n) for n in names]
    epochs = {v["epoch"] for v in views}
    return len(epochs) == 1 and all(
        not v["rebalance"]["running"] and v["rebalance"]["pending"] == 0
        and v["rebalance"]["epoch"] == v["epoch"] for v in views
    )  # fmt: skip


@pytest.mark.parametrize("cluster3", [1], indirect=True)
def test_join_moves_only_newly_owned_chunks_while_lookups_answer(cluster3: Cluster) -> None:
    c = cluster3
    out = [np.empty(LAYOUT.chunk_shape, np.float16)]
    with client(c) as kv:
        assert router(kv).refresh()
        assert all(kv.put(prompt(i), [chunk(i)]) == 1 for i in range(PROMPTS))
        before = {i: owner_of(kv, i)[0] for i in range(PROMPTS)}
        c.start("n4")
        names = ["n1", "n2", "n3", "n4"]
        hits = asked = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # lookups go on while n4 joins and chunks move
            for i in range(PROMPTS):
                got = kv.get(prompt(i), out)
                hits += got == 1 and out[0].tobytes() == chunk(i).tobytes()
                asked += 1
            try:
                done = c.wait_serving(names, on=names, timeout_s=0.5) and _rebalanced(c, names)
            except AssertionError:
                done = False
            if done:
                break
        assert router(kv).refresh() and len(router(kv).placement.serving) == 4
        after = {i: owner_of(kv, i)[0] for i in range(PROMPTS)}
        assert all(after[i] in (before[i], "n4") for i in range(PROMPTS))  # nothing else moves
        gained = {i for i in range(PROMPTS) if after[i] == "n4"}
        assert gained, "24 keys over 4 nodes: n4 owns some"
        for name in names:
            assert held_by(c, name, kv) == {i for i in range(PROMPTS) if after[i] == name}
        moved = sum(c.members(n)["rebalance"]["moved_chunks"] for n in names)
        assert moved == len(gained)
        # Reads go on during the move (a miss is an answer: the engine recomputes); a client
        # whose view lags the hand-over can miss a chunk for a moment (3 of 24 seen in one
        # run), so this asks that most reads hit, not all.
        assert asked and hits >= 0.75 * asked, (hits, asked)
        assert all(kv.get(prompt(i), out) == 1 for i in range(PROMPTS))
