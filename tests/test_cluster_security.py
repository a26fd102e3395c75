"""Only the cluster's own nodes are members: real agents with real Serf on loopback.

The attack of docs/CLUSTER.md ("Keys and membership"): a Serf agent without the gossip key
cannot join; one with the gossip key but without the cluster peer key is listed by gossip and
refused by every agent (no connection, no token, no chunk), and the real nodes keep every
chunk. Malformed tags never break the view, even after their member left. Serf's RPC needs its
key. The gossip keyring rotates across 3 agents with `dpuctl cluster keys`.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster, gossip_key, write_secret
from waits import wait_until

from dpu_agent.cluster import SerfClient, SerfProcess, free_port
from host_shim import KVClient
from kvproto.keys import ChunkLayout
from kvproto.serf import SerfError

LAYOUT = ChunkLayout("cluster-sec", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"cluster-sec-salt-0123456"
CHUNKS = 40
NAMES = ["s1", "s2", "s3"]
CLUSTER_POLL_S = 0.3  # each look opens a control session to an agent (hello, members)

pytestmark = pytest.mark.skipif(shutil.which("serf") is None, reason="needs serf (apt)")


def _prompt(i: int) -> np.ndarray:
    return np.arange(16, dtype=np.uint32) + 1000 * (i + 1)


def _chunk(i: int) -> np.ndarray:
    return np.full(LAYOUT.chunk_shape, i % 100, np.float16)


class Listener:
    """A TCP port that records every connection and byte (the attacker's `ctl`)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
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
            self.connections += 1
            conn.settimeout(1.0)
            try:
                while data := conn.recv(65536):
                    self.received += data
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("clsec"), replicas=2)
    try:
        for name in NAMES:
            c.start(name)
        c.wait_serving(NAMES, on=NAMES, timeout_s=90)
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            assert kv.router is not None and kv.router.refresh()
            for i in range(CHUNKS):
                assert kv.put(_prompt(i), [_chunk(i)]) == 1
        yield c
    finally:
        c.stop_all()


def _holdings(c: Cluster) -> dict[str, int]:
    """Chunks each node holds (its own lookup, with the tenant's token, on that node)."""
    out = {}
    for name in NAMES:
        url = c.nodes[name].agent.control_url
        with KVClient(url, "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            out[name] = sum(kv.lookup(_prompt(i)) for i in range(CHUNKS))
    return out


def _view(c: Cluster, name: str) -> dict[str, dict]:
    return {m["name"]: m for m in c.members(name)["members"]}


def _rpc_key(c: Cluster, name: str = "s1") -> str:
    return (c.root / name / "serf-rpc.key").read_text().strip()


def _fake(c: Cluster, name: str, tags: dict[str, str], keyring: Path | None) -> SerfProcess:
    p = SerfProcess(
        name, bind=f"127.0.0.1:{free_port()}", rpc_addr=f"127.0.0.1:{free_port()}", tags=tags,
        keyring_file=keyring, log_path=c.root / f"serf-{name}.log",
    )  # fmt: skip
    p.wait_ready().close()
    return p


def test_serf_without_the_gossip_key_cannot_join(cluster: Cluster) -> None:
    c = cluster
    listener = Listener()
    tags = {"kv": "1", "state": "serving", "cap": str(1 << 49),
            "ctl": f"tcp://127.0.0.1:{listener.port}"}  # fmt: skip
    evil = _fake(c, "evil-plain", tags, keyring=None)
    try:
        with evil.wait_ready() as rpc, pytest.raises(SerfError, match="encrypt"):
            rpc.join([c.nodes["s1"].serf_bind])
        time.sleep(2.0)
        assert all("evil-plain" not in _view(c, n) for n in NAMES)
        assert listener.connections == 0
    finally:
        evil.kill()
        listener.close()


def test_member_without_the_cluster_key_gets_no_token_no_chunk_no_traffic(
    cluster: Cluster,
) -> None:
    """The attack of the first finding, with the gossip key stolen: a huge capacity and a
    `ctl` pointing at the attacker. Before: the rebalancers connected with the tenant token,
    handed it every chunk and deleted their own copies."""
    c = cluster
    before = _holdings(c)
    assert sum(before.values()) == 2 * CHUNKS  # R=2
    listener = Listener()
    keyring = write_secret(c.root / "evil-keyring.json",
                           (c.root / "keyring.json").read_text())  # fmt: skip
    tags = {"kv": "1", "state": "serving", "cap": str(1 << 49), "zone": "",
            "ctl": f"tcp://127.0.0.1:{listener.port}", "nvme": f"127.0.0.1:{listener.port}",
            "auth": "forged-forged-forged-0"}  # fmt: skip
    evil = _fake(c, "evil-keyed", tags, keyring)
    try:
        with evil.wait_ready() as rpc:
            assert rpc.join([c.nodes["s1"].serf_bind]) == 1  # gossip lets it in ...
        for n in NAMES:  # ... every agent sees it and refuses it
            wait_until(lambda n=n: _view(c, n).get("evil-keyed", {}).get("status") == "refused",
                       f"{n} to refuse evil-keyed", 30, CLUSTER_POLL_S)  # fmt: skip
        assert "member_tag" in _view(c, "s1")["evil-keyed"]["reason"]
        status = c.dpuctl("s2", "cluster", "status", "--json")
        assert json.loads(status.stdout)["refused"] == ["evil-keyed"], status.stdout
        time.sleep(4.0)  # refreshes every second: rebalancers had several passes to act
        for n in NAMES:
            assert c.members(n)["serving"] == 3
        assert listener.connections == 0 and listener.received == b""
        assert _holdings(c) == before
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            r = kv.router
            assert (
                r is not None
                and r.refresh()
                and {n.name for n in r.placement.serving} == set(NAMES)
            )
            out = [np.empty(LAYOUT.chunk_shape, np.float16)]
            for i in range(CHUNKS):
                assert kv.get(_prompt(i), out) == 1 and (out[0] == i % 100).all()
    finally:
        evil.kill()
        listener.close()
        _force_leave(c, "evil-keyed")


def _force_leave(c: Cluster, name: str) -> None:
    """The operator's cleanup of a dead member (else keyring queries wait for it)."""
    key = (c.root / "s1" / "serf-rpc.key").read_text().strip()
    with SerfClient(c.nodes["s1"].serf_rpc, auth_key=key) as rpc:
        rpc.force_leave(name)


def test_malformed_tags_never_break_the_view_even_after_the_member_left(
    cluster: Cluster,
) -> None:
    """Before: one member tagged cap=abc made `members` fail on every agent (clients saw 0
    serving nodes), and kept failing after it left."""
    c = cluster
    keyring = write_secret(c.root / "bad-keyring.json", (c.root / "keyring.json").read_text())
    tags = {"kv": "1", "state": "serving", "cap": "abc", "ctl": "tcp://127.0.0.1:1"}
    bad = _fake(c, "bad-cap", tags, keyring)
    try:
        with bad.wait_ready() as rpc:
            assert rpc.join([c.nodes["s2"].serf_bind]) == 1
        for n in NAMES:
            wait_until(lambda n=n: "bad-cap" in _view(c, n), f"{n} to list bad-cap", 30,
                       CLUSTER_POLL_S)  # fmt: skip
            assert c.members(n)["serving"] == 3
        assert "cap='abc'" in _view(c, "s1")["bad-cap"]["reason"]
        bad.stop()  # a graceful leave: Serf keeps it as `left` for a while
        time.sleep(3.0)
        for n in NAMES:
            assert c.members(n)["serving"] == 3
        assert sum(_holdings(c).values()) == 2 * CHUNKS
    finally:
        bad.kill()


def test_serf_rpc_needs_the_generated_key(cluster: Cluster) -> None:
    """Before: no RPC key by default; any local user could set tags or force-leave."""
    node = cluster.nodes["s1"]
    key_file = cluster.root / "s1" / "serf-rpc.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    with SerfClient(node.serf_rpc) as rpc, pytest.raises(SerfError, match="Authentication"):
        rpc.members()
    with SerfClient(node.serf_rpc, auth_key=_rpc_key(cluster)) as rpc:
        assert {m.name for m in rpc.members() if m.status == "alive"} >= set(NAMES)


def test_gossip_key_rotation_with_dpuctl_across_three_agents(cluster: Cluster) -> None:
    c = cluster
    old = json.loads((c.root / "keyring.json").read_text())[0]
    new = gossip_key()

    def keys(*args: str) -> dict:
        r = c.dpuctl("s1", "cluster", "keys", *args, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    # a member an earlier test stopped counts in Serf's key queries until memberlist marks it
    # dead (a probe round, longer on a loaded box): wait for every live node to answer
    deadline = time.monotonic() + 60
    while (r := c.dpuctl("s1", "cluster", "keys", "list", "--json")).returncode != 0:
        assert time.monotonic() < deadline, r.stdout + r.stderr
        time.sleep(1.0)
    assert json.loads(r.stdout)["keys"] == {old: 3}
    # A member cut off (here killed) is `failed`, and Serf's key query reaches live members
    # only. Before: every step succeeded without it, and once back it could not read the
    # others' gossip: the cluster stayed split (attack pass, a partition during a rotation).
    # Each change is refused now, naming it, until it is back or force-left.
    with SerfClient(c.nodes["s1"].serf_rpc, auth_key=_rpc_key(c)) as rpc:
        gone = _fake(c, "gone", {}, c.root / "keyring.json")
        with gone.wait_ready() as fake:
            assert fake.join([c.nodes["s2"].serf_bind]) == 1
        gone.kill()

        def status(node: str) -> str:
            return {m.name: m.status for m in rpc.members()}.get(node, "")

        wait_until(lambda: status("gone") == "failed", "gone to be failed", 60, 0.5)
        for step in (["install", new], ["use", old], ["remove", new]):
            refused = c.dpuctl("s1", "cluster", "keys", *step)
            out = refused.stdout + refused.stderr
            assert refused.returncode == 1 and "gone" in out and "failed" in out, out
        failed = [m.name for m in rpc.members() if m.status == "failed"]  # earlier tests' too
        for node in failed:
            r = c.dpuctl("s1", "cluster", "force-leave", node, "--json")
            assert r.returncode == 0 and json.loads(r.stdout)["was"] == "failed", r.stderr
        wait_until(lambda: all(status(n) == "left" for n in failed), "force-left", 30, 0.5)
        alive = c.dpuctl("s1", "cluster", "force-leave", "s2")
        assert alive.returncode == 1 and "alive" in alive.stdout + alive.stderr
    assert keys("install", new)["errors"] == 0
    assert keys("list")["keys"] == {old: 3, new: 3}
    assert keys("use", new)["errors"] == 0
    refused = c.dpuctl("s1", "cluster", "keys", "remove", new)  # the primary stays
    assert refused.returncode != 0 and "primary" in refused.stdout + refused.stderr
    assert keys("remove", old)["errors"] == 0
    assert keys("list")["keys"] == {new: 3}
    for n in NAMES:  # persisted: a restart keeps the new key
        assert json.loads((c.root / n / "serf-keyring.json").read_text()) == [new]
    bad = c.dpuctl("s1", "cluster", "keys", "install", "not-a-key")
    assert bad.returncode != 0 and "base64" in bad.stdout + bad.stderr
    # a Serf holding only the retired key cannot join any more
    stale = write_secret(c.root / "stale-keyring.json", json.dumps([old]))
    late = _fake(c, "late", {"kv": "1"}, stale)
    try:
        with late.wait_ready() as rpc, pytest.raises(SerfError):
            rpc.join([c.nodes["s3"].serf_bind])
    finally:
        late.kill()
    c.wait_serving(NAMES, on=NAMES, timeout_s=30)
    assert sum(_holdings(c).values()) == 2 * CHUNKS
