"""dpuctl cluster members|status|join|leave against two real agents with real Serf; leave
drains first: every chunk is still served after the node is gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cluster_harness import Cluster

from dpu_agent.cli import cli
from host_shim import KVClient
from kvproto.keys import ChunkLayout

pytestmark = [
    pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary"),
    pytest.mark.timeout(240),
]

LAYOUT = ChunkLayout("cluster-cli", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"cluster-cli-salt-012345"


def test_members_status_join_and_drained_leave(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    try:
        c.start("a")
        c.start("b")
        c.wait_serving(["a", "b"], on=["a", "b"])
        r = c.dpuctl("a", "cluster", "members", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert sorted(m["name"] for m in doc["members"]) == ["a", "b"] and doc["epoch"] > 0
        r = c.dpuctl("a", "cluster", "status", "--json")
        st = json.loads(r.stdout)
        assert st["clustered"] and st["serving"] == 2 and st["failed"] == []
        human = c.dpuctl("a", "cluster", "status")
        assert human.returncode == 0 and "epoch" in human.stdout and "rebalance" in human.stdout
        r = c.dpuctl("a", "cluster", "join", c.nodes["b"].serf_bind, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["joined"] == 1, r.stdout + r.stderr
        chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(16)]
        prompts = [np.arange(16, dtype=np.uint32) + 1000 * (i + 1) for i in range(16)]
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            assert all(kv.put(p, [ch]) == 1 for p, ch in zip(prompts, chunks, strict=True))
        r = c.dpuctl("b", "cluster", "leave", "--json", "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["left"] is True
        c.wait_serving(["a"], on=["a"])
        with KVClient(c.nodes["a"].agent.control_url + ",", "default", c.token, LAYOUT,
                      SALT, io_queues=1) as kv:  # fmt: skip
            out = [np.empty(LAYOUT.chunk_shape, np.float16)]
            for p, ch in zip(prompts, chunks, strict=True):
                assert kv.get(p, out) == 1 and out[0].tobytes() == ch.tobytes()
    finally:
        c.stop_all()


def test_cluster_commands_outside_a_cluster_fail_cleanly(tmp_path: Path) -> None:
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path)}
    r = CliRunner().invoke(cli, ["cluster", "join", "127.0.0.1:1", "--json"], env=env)
    assert r.exit_code == 1 and "not in a cluster" in json.loads(r.output)["error"]
    assert CliRunner().invoke(cli, ["cluster", "join", "--json"], env=env).exit_code == 2
    r = CliRunner().invoke(cli, ["cluster", "leave", "--timeout", "0"], env=env)
    assert r.exit_code == 2


def test_left_node_joins_again_without_an_agent_restart(tmp_path: Path) -> None:
    """Regression: after `dpuctl cluster leave` the node's Serf had exited (Serf leaves, then
    exits) and `dpuctl cluster join` failed until the agent was restarted. Now the agent
    starts its Serf again alone (still `leaving`, owning nothing), and a join brings it back
    serving: it owns keys again and what is put to it is served."""
    c = Cluster(tmp_path)
    try:
        c.start("a")
        c.start("b")
        c.wait_serving(["a", "b"], on=["a", "b"])
        b = c.nodes["b"].agent
        r = c.dpuctl("b", "cluster", "leave", "--json", "--timeout", "60")
        assert r.returncode == 0 and json.loads(r.stdout)["left"] is True, r.stdout + r.stderr
        c.wait_serving(["a"], on=["a"])
        c.wait_serving([], on=["b"])  # b's own Serf is back, alone, and b owns nothing
        assert b.proc.poll() is None
        r = c.dpuctl("b", "cluster", "join", c.nodes["a"].serf_bind, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["joined"] == 1 and doc["serving_again"] is True, doc
        c.wait_serving(["a", "b"], on=["a", "b"])
        chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(16)]
        prompts = [np.arange(16, dtype=np.uint32) + 1000 * (i + 1) for i in range(16)]
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            r_ = kv.router
            assert r_ is not None and r_.refresh() and len(r_.placement.serving) == 2
            assert all(kv.put(p, [ch]) == 1 for p, ch in zip(prompts, chunks, strict=True))
            owners = {r_.placement.owners(kv.keys(p)[0], 1)[0].name for p in prompts}
            assert "b" in owners, owners
            out = [np.empty(LAYOUT.chunk_shape, np.float16)]
            for p, ch in zip(prompts, chunks, strict=True):
                assert kv.get(p, out) == 1 and out[0].tobytes() == ch.tobytes()
    finally:
        c.stop_all()
