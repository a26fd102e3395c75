"""Cluster-wide tenants with etcd as the source of truth: a real etcd (auth on) and real
agents on loopback, ephemeral ports, random names.

What failed before: `dpuctl tenants add` on one node made the tenant on that node only (the
other owners refused its token, so a cluster client stored only that node's share of puts),
the same command on another node printed another token, and `tenants remove` erased only the
node it ran on (the others kept the chunks and accepted the token)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import SMALL_TIERS, Cluster
from etcd_harness import ETCD_BIN, BlackHoleProxy, Etcd, start_etcd
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.cluster import ETCD_CALL_TIMEOUT_S, EtcdClient, EtcdError
from dpu_agent.cluster._peer import PeerAuth, open_peer
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import AgentUnreachable, ControlChannel, ControlError
from kvproto.control import ADMIN_TENANT
from kvproto.placement import Node

pytestmark = [
    pytest.mark.skipif(ETCD_BIN is None, reason="needs etcd (Debian package etcd-server)"),
    pytest.mark.timeout(300),
]

CHANGE_DEADLINE_S = 20.0  # "within seconds" on a loaded 2-core box: watch + apply + margin


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    e = start_etcd(tmp_path / "etcd")
    yield e
    e.stop()


def start_node(root: Path, name: str, etcd_env: dict[str, str]) -> AgentProcess:
    env = {**SMALL_TIERS, "DPUKV_METRICS_ENABLED": "0", "DPUKV_AGENT_NODE_NAME": name, **etcd_env}
    return spawn_agent(root / name, env=env)


def dpuctl(a: AgentProcess, *args: str) -> tuple[int, dict]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(a.data_dir)}
    p = subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args, "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return p.returncode, json.loads(p.stdout or "{}")


def admin(a: AgentProcess, op: str, **fields: object) -> dict:
    with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token, timeout_s=10.0) as adm:
        adm.connect()
        return adm.call(op, **fields)


def accepts(a: AgentProcess, tenant: str, token: str) -> bool:
    try:
        with ControlChannel(a.control_url, tenant, token, timeout_s=5.0) as ch:
            ch.connect()
        return True
    except ControlError as e:
        assert e.code == "auth", e
        return False


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = CHANGE_DEADLINE_S) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def erased(a: AgentProcess, tenant: str) -> bool:
    """The tenant's XTS key is gone from the key file and its NVMe file deleted."""
    keys = json.loads((a.data_dir / "keys.json").read_text())
    return tenant not in keys and not (a.data_dir / "nvme" / tenant / "nvme.img").exists()


def test_tenants_add_rotate_remove_reach_every_node_with_one_down(
    tmp_path: Path, etcd: Etcd
) -> None:
    """5 agents; one is down during the add and another during the rotate and the remove."""
    nodes = {f"n{i}": start_node(tmp_path, f"n{i}", etcd.env()) for i in range(5)}
    try:
        nodes["n4"].stop()  # down during the add
        rc, out = dpuctl(nodes["n0"], "tenants", "add", "acme")
        assert rc == 0, out
        token = out["token"]
        rc, again = dpuctl(nodes["n1"], "tenants", "add", "acme")  # no second token
        assert rc != 0 and "exists" in again["error"], again
        rc, bad = dpuctl(nodes["n2"], "tenants", "add", "_admin")  # never written to etcd
        assert rc != 0 and "tenant name" in bad["error"], bad
        up = ["n0", "n1", "n2", "n3"]
        took = max(wait_for(f"{n} accepts", lambda n=n: accepts(nodes[n], "acme", token))
                   for n in up)  # fmt: skip
        print(f"add visible on 4 nodes within {took:.2f} s")
        for i, n in enumerate(up):
            with KVClient(nodes[n].control_url, "acme", token, LAYOUT, SALT, io_queues=1) as c:
                assert c.put(tokens_for(i, 3), chunks_for(i, 3)) == 3
        nodes["n4"] = start_node(tmp_path, "n4", etcd.env())  # missed the add: has it now
        wait_for("n4 accepts", lambda: accepts(nodes["n4"], "acme", token))

        nodes["n3"].stop()  # down during the rotate and the remove
        live = ["n0", "n1", "n2", "n4"]
        rc, out = dpuctl(nodes["n2"], "tenants", "rotate", "acme")
        assert rc == 0, out
        token2 = out["token"]
        assert token2 != token
        for n in live:
            wait_for(f"{n} refuses the old token", lambda n=n: not accepts(nodes[n], "acme", token))
            assert accepts(nodes[n], "acme", token2)
        with KVClient(nodes["n0"].control_url, "acme", token2, LAYOUT, SALT, io_queues=1) as c:
            assert c.lookup(tokens_for(0, 3)) == 3  # rotation keeps the data

        rc, out = dpuctl(nodes["n1"], "tenants", "remove", "acme", "--yes")
        assert rc == 0, out
        assert out["key_destroyed"] is True and out["records_dropped"] == 3
        assert etcd.tenant_names() == []
        for n in live:
            wait_for(f"{n} refuses the token", lambda n=n: not accepts(nodes[n], "acme", token2))
            wait_for(f"{n} erased acme", lambda n=n: erased(nodes[n], "acme"))

        nodes["n3"] = start_node(tmp_path, "n3", etcd.env())  # was down: erases before serving
        assert not accepts(nodes["n3"], "acme", token2)
        assert not accepts(nodes["n3"], "acme", token)
        wait_for("n3 erased acme", lambda: erased(nodes["n3"], "acme"))
        assert "acme" not in {t["name"] for t in admin(nodes["n3"], "tenants_list")["tenants"]}

        given = tmp_path / "acme.token"  # the name again, with a token the operator chose
        given.write_text("operator-chosen-token-" + "z" * 24 + "\n")
        given.chmod(0o600)
        rc, out = dpuctl(nodes["n3"], "tenants", "add", "acme", "--token-file", str(given))
        assert rc == 0, out
        token3 = out["token"]
        assert token3 == given.read_text().strip()
        for i, n in enumerate(up):
            wait_for(f"{n} accepts the new acme", lambda n=n: accepts(nodes[n], "acme", token3))
            with KVClient(nodes[n].control_url, "acme", token3, LAYOUT, SALT, io_queues=1) as c:
                assert c.lookup(tokens_for(i, 3)) == 0
    finally:
        for a in nodes.values():
            a.stop(timeout_s=30)


def test_node_cut_off_from_etcd_keeps_known_tenants_and_applies_changes_on_heal(
    tmp_path: Path, etcd: Etcd
) -> None:
    port = int(etcd.url.rsplit(":", 1)[1])
    proxy = BlackHoleProxy(port)
    nodes = {f"p{i}": start_node(tmp_path, f"p{i}", etcd.env()) for i in range(2)}
    nodes["p2"] = start_node(tmp_path, "p2", etcd.env(proxy.url))
    try:
        token = admin(nodes["p0"], "tenant_add", tenant="acme")["token"]
        for n, a in nodes.items():
            wait_for(f"{n} accepts", lambda a=a: accepts(a, "acme", token))
        with KVClient(nodes["p2"].control_url, "acme", token, LAYOUT, SALT, io_queues=1) as c:
            assert c.put(tokens_for(7, 2), chunks_for(7, 2)) == 2

        proxy.cut()
        admin(nodes["p0"], "tenant_remove", tenant="acme")
        token_b = admin(nodes["p1"], "tenant_add", tenant="bravo")["token"]

        def cut_off() -> bool:
            return admin(nodes["p2"], "members")["tenant_source"]["reachable"] is False

        wait_for("p2 reports etcd unreachable", cut_off)
        assert accepts(nodes["p2"], "acme", token)  # known tenants keep being served
        assert not accepts(nodes["p2"], "bravo", token_b)  # nothing new without etcd
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="etcd did not take the change"):
            admin(nodes["p2"], "tenant_add", tenant="charlie")
        refused_s = time.monotonic() - t0
        assert refused_s < 10.0, refused_s  # bounded by the etcd call deadline, not hung

        proxy.heal()
        took = wait_for("p2 refuses acme", lambda: not accepts(nodes["p2"], "acme", token))
        print(f"removal applied {took:.2f} s after the heal (refused in {refused_s:.2f} s)")
        wait_for("p2 erased acme", lambda: erased(nodes["p2"], "acme"))
        wait_for("p2 serves bravo", lambda: accepts(nodes["p2"], "bravo", token_b))
        assert admin(nodes["p2"], "members")["tenant_source"]["reachable"] is True
        assert etcd.tenant_names() == ["bravo"]

        proxy.cut()  # a restart while cut off: no cluster tenant before a read of etcd
        nodes["p2"].stop()
        nodes["p2"] = start_node(tmp_path, "p2", etcd.env(proxy.url))
        assert not accepts(nodes["p2"], "bravo", token_b)
        assert accepts(nodes["p2"], "default", nodes["p2"].token)  # its own tenant serves
        proxy.heal()
        wait_for("p2 serves bravo again", lambda: accepts(nodes["p2"], "bravo", token_b))
    finally:
        for a in nodes.values():
            a.stop(timeout_s=30)
        proxy.close()


def test_tenants_over_mutual_tls_with_etcd_auth(tmp_path: Path) -> None:
    """etcd on https only, demanding a client certificate; the nodes verify etcd's certificate
    and log in as their etcd user; a node without the client certificate gets nothing."""
    e = start_etcd(tmp_path / "etcd", tls=True)
    nodes: list[AgentProcess] = []
    try:
        nodes = [start_node(tmp_path, f"t{i}", e.env()) for i in range(2)]
        token = admin(nodes[0], "tenant_add", tenant="acme")["token"]
        wait_for("t1 accepts", lambda: accepts(nodes[1], "acme", token))
        assert e.tenant_names() == ["acme"]
        no_cert = {k: v for k, v in e.env().items() if "CERT" not in k and "KEY" not in k}
        nodes.append(start_node(tmp_path, "t2", no_cert))
        assert admin(nodes[2], "members")["tenant_source"]["reachable"] is False
        assert not accepts(nodes[2], "acme", token)
    finally:
        for a in nodes:
            a.stop(timeout_s=30)
        e.stop()


@pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary")
def test_tenant_added_on_one_node_takes_every_owners_share_of_cluster_puts(
    tmp_path: Path, etcd: Etcd
) -> None:
    """3 agents with real Serf: a tenant added on one node serves all 50 cluster puts."""
    c = Cluster(tmp_path / "c")
    try:
        for name in ("a", "b", "c"):
            c.start(name, extra_env=etcd.env())
        c.wait_serving(["a", "b", "c"], on=["a", "b", "c"])
        rc, out = dpuctl(c.nodes["a"].agent, "tenants", "add", "acme")
        assert rc == 0, out
        token = out["token"]
        for n in c.nodes.values():
            wait_for(f"{n.name} accepts", lambda n=n: accepts(n.agent, "acme", token))
        prompts = [np.arange(16, dtype=np.uint32) + 1_000_000 * (i + 1) for i in range(50)]
        kv = KVClient(c.seeds(), "acme", token, LAYOUT, SALT, io_queues=1, timeout_s=5.0)
        with kv:
            data = chunks_for(3, 1)
            stored = sum(kv.put(p, data) for p in prompts)
            out_buf = [np.empty(LAYOUT.chunk_shape, np.float16)]
            got = sum(kv.get(p, out_buf) for p in prompts)
        assert (stored, got) == (50, 50)
        # A peer session names the incarnation it acts for: a node that missed a remove and
        # re-add of "acme" (cut off from etcd) pushed the removed tenant's chunks into the new
        # one (an attack pass: 9 of 30 removed chunks read back with the new token)
        a = c.nodes["a"].agent
        held = json.loads((a.data_dir / "tenants.json").read_text())["cluster"]["acme"]
        member = Node(name="a", control=a.control_url)
        for inc, ok in ((held["incarnation"], True), ("0123456789abcdef", False), (None, False)):
            auth = PeerAuth("b", c.peer_keys, incarnation=lambda _t, inc=inc: inc)
            peer = open_peer(member, "acme", auth)
            try:
                if ok:
                    assert peer.lookup_keys([bytes(16)]) == 0  # a session of acme
                else:
                    with pytest.raises(AgentUnreachable, match="another incarnation"):
                        peer._ensure()
            finally:
                peer.close()
    finally:
        c.stop_all()


def test_etcd_client_fails_over_and_pays_a_dead_endpoint_once(etcd: Etcd) -> None:
    """A black-holed first endpoint costs one call deadline, then the live one goes first."""
    dead = BlackHoleProxy(int(etcd.url.rsplit(":", 1)[1]))
    dead.cut()
    try:
        password = etcd.password_file.read_text().strip()
        c = EtcdClient(f"{dead.url},{etcd.url}", user=etcd.user, password=password)
        t0 = time.monotonic()
        assert c.create(etcd.prefix + "/tenants/x", b"{}") is True
        first_s = time.monotonic() - t0
        t0 = time.monotonic()
        kvs, _ = c.range_prefix(etcd.prefix + "/")
        second_s = time.monotonic() - t0
        assert [kv.key for kv in kvs] == [etcd.prefix + "/tenants/x"]
        assert first_s >= ETCD_CALL_TIMEOUT_S * 0.9 and second_s < ETCD_CALL_TIMEOUT_S / 2
        assert c.create(etcd.prefix + "/tenants/x", b"{}") is False  # create is create-only
        with pytest.raises(EtcdError, match="permission denied"):  # outside its prefix
            c.create("/elsewhere/x", b"{}")
    finally:
        dead.close()
