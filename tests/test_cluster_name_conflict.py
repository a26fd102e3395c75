"""A second agent started under a live member's node name (a copied config, a node restored
elsewhere): Serf throws the newcomer out, and the agent restarted its Serf every few seconds
for good without saying why (an attack pass). It now logs `cluster_node_name_conflict` once,
naming the other node's address."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from cluster_harness import Cluster, secrets_env

from dpu_agent.cluster import free_port
from dpu_agent.cluster._serf_process import name_conflict_in
from dpu_agent.testing import spawn_agent

# Serf 0.8's own lines (recorded in that attack pass: the newcomer's serf.log)
RECORDED = """\
    2026/12/07 16:19:28 [ERR] memberlist: Conflicting address for n2. Mine: 127.0.0.1:17314 \
Theirs: 127.0.0.1:17306 Old state: 0
    2026/12/07 16:19:28 [ERR] serf: Node name conflicts with another node at 127.0.0.1:17306. \
Names must be unique! (Resolution enabled: true)
    2026/12/07 16:19:31 [WARN] serf: minority in name conflict resolution, quitting [0 / 1]
"""
CONFLICT_S_MAX = 60.0  # Serf's resolution takes seconds; a loaded 2-core box


def test_serfs_quit_over_a_name_conflict_is_recognised(tmp_path: Path) -> None:
    log = tmp_path / "serf.log"
    log.write_text(RECORDED)
    assert name_conflict_in(log) == "127.0.0.1:17306"
    log.write_text(RECORDED.rsplit("\n", 2)[0] + "\n")  # the winner: it logs, it stays
    assert name_conflict_in(log) is None
    assert name_conflict_in(tmp_path / "missing.log") is None


@pytest.mark.skipif(shutil.which("serf") is None, reason="needs serf (apt-get install serf)")
@pytest.mark.timeout(180)
def test_a_second_agent_with_a_members_name_says_so(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "c", replicas=1)
    try:
        c.start("n1")
        c.start("n2")
        c.wait_serving(["n1", "n2"], on=["n1", "n2"])
        env = {**c.nodes["n2"].env, **secrets_env(c.root, c.root / "twin")}
        env.pop("DPUKV_AGENT_DATA_DIR")
        env["DPUKV_CLUSTER_SERF_BIND"] = f"127.0.0.1:{free_port()}"
        env["DPUKV_CLUSTER_SERF_RPC"] = f"127.0.0.1:{free_port()}"
        env["DPUKV_CLUSTER_JOIN"] = c.nodes["n1"].serf_bind
        twin = spawn_agent(c.root / "twin", env=env, config=c.root / "cluster.toml")
        try:
            log = c.root / "twin" / "agent.log"
            t0 = time.monotonic()
            while "cluster_node_name_conflict" not in log.read_text(errors="replace"):
                assert time.monotonic() - t0 < CONFLICT_S_MAX, log.read_text()[-3000:]
                time.sleep(0.5)
            c.wait_serving(["n1", "n2"], on=["n1", "n2"])  # the real n2 stays a member
        finally:
            twin.stop(timeout_s=20)
    finally:
        c.stop_all()
