"""A member killed (kill -9) and back before the cluster noticed: what it lost comes back.

Found by an attack pass (three real agents, real Serf, R=2): a killed agent loses its DRAM tier;
back quickly under the same name, no view change was seen, and the periodic anti-entropy runs
on each key's first owner over the chunks it holds, so a first owner that had lost a chunk never
fetched it back: the other owner held the only copy (45 of 300 keys for 30 s), and a second
kill lost them (255 of 300 read back). Now a start after an unclean stop fetches back, in its
first rounds, what it first-owns and another owner holds.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster

from dpu_agent.testing import spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

pytestmark = [
    pytest.mark.skipif(shutil.which("serf") is None, reason="needs serf (apt-get install serf)"),
    pytest.mark.timeout(240),
]

LAYOUT = ChunkLayout("repair-test", "uint8", 1, 1, 2048, chunk_tokens=1)  # 2 KiB chunks
SALT = b"kill-restart-repair"
CHUNKS = 120
NAMES = ["n1", "n2", "n3"]
ENV = {"DPUKV_CLUSTER_ANTI_ENTROPY_INTERVAL_S": "2"}
REPAIR_S_MAX = 45.0  # the first pull round runs ~2 s after the view settles; a loaded box


def prompt(i: int) -> np.ndarray:
    return np.array([1_000_003 * (i + 1)], dtype=np.uint32)


def chunk(i: int) -> np.ndarray:
    return np.full(LAYOUT.chunk_shape, i % 251, np.uint8)


def restart_killed(c: Cluster, name: str) -> None:
    """Kill -9 member `name` and start it again as a deployment does: the same data directory
    and the same Serf addresses (the harness's start() picks new ones, which the others
    refuse as a conflicting address until the old one is reaped: tens of seconds)."""
    node = c.nodes[name]
    node.agent.proc.kill()
    node.agent.proc.wait()
    for addr in (node.serf_bind, node.serf_rpc):  # its Serf goes on SIGTERM (pdeathsig)
        host, port = addr.rsplit(":", 1)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_server((host, int(port))):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{addr} still held"
                time.sleep(0.1)
    env = dict(node.env)
    env["DPUKV_CLUSTER_JOIN"] = ",".join(
        n.serf_bind for n in c.nodes.values() if n.name != name and n.agent.proc.poll() is None
    )
    node.agent = spawn_agent(Path(env["DPUKV_AGENT_DATA_DIR"]), env=env,
                             config=c.root / "cluster.toml")  # fmt: skip


def held_by(c: Cluster, name: str) -> set[int]:
    """The chunks node `name` itself holds (a client of that one agent)."""
    with KVClient(c.nodes[name].agent.control_url, "default", c.token, LAYOUT, SALT) as kv:
        return {i for i in range(CHUNKS) if kv.lookup(prompt(i)) == 1}


def test_a_killed_member_fetches_back_what_it_first_owns(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "c", replicas=2)
    try:
        for n in NAMES:
            c.start(n, extra_env=ENV)
        c.wait_serving(NAMES, on=NAMES)
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, timeout_s=5.0) as kv:
            assert sum(kv.put(prompt(i), [chunk(i)]) for i in range(CHUNKS)) == CHUNKS
        before = held_by(c, "n1")
        assert before, "n1 owns some of the chunks"
        restart_killed(c, "n1")  # its DRAM tier (where these 2 KiB chunks are) is gone
        c.wait_serving(NAMES, on=NAMES)
        t0 = time.monotonic()
        while (got := held_by(c, "n1")) < before:
            assert time.monotonic() - t0 < REPAIR_S_MAX, (
                f"n1 holds {len(got & before)} of the {len(before)} chunks it held before the "
                f"kill, {REPAIR_S_MAX} s after its restart"
            )
            time.sleep(1.0)
        for other in ("n2", "n3"):  # now any other member may go: every chunk has 2 copies
            gone = c.nodes[other].agent
            gone.proc.kill()
            gone.proc.wait()
            with KVClient(c.nodes["n1"].agent.control_url, "default", c.token, LAYOUT,
                          SALT) as kv:  # fmt: skip
                out = [np.empty(LAYOUT.chunk_shape, np.uint8)]
                for i in sorted(before):
                    assert kv.get(prompt(i), out) == 1 and np.array_equal(out[0], chunk(i)), i
            restart_killed(c, other)
            c.wait_serving(NAMES, on=NAMES)
    finally:
        c.stop_all()
