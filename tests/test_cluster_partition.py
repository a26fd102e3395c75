"""A partitioned node: its Serf agent lives in a network namespace this test makes (veth pair);
taking the link down makes the others mark it failed and route around it; link up, it is back.
The agent of that node uses the operator-run Serf path ([cluster] serf_start = false)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster

from dpu_agent.cluster import SerfProcess, free_port
from host_shim import KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("cluster-part", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"cluster-part-salt-01234"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture()
def netns() -> Iterator[tuple[str, str, str, str]]:
    """(namespace, ns-side veth, host address, namespace address); deleted afterwards."""
    if shutil.which("serf") is None or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs serf, root and iproute2 to make a network namespace")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"i13p{tag}", f"i13a{tag}", f"i13b{tag}"
    net = f"10.213.{int(tag[:2], 16)}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr!r}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{net}.1/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, ns_if, f"{net}.1", f"{net}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _status_on(c: Cluster, observer: str, node: str) -> str:
    return {m["name"]: m["status"] for m in c.members(observer)["members"]}.get(node, "")


@pytest.mark.timeout(240)
def test_partitioned_node_is_marked_failed_and_comes_back(
    tmp_path: Path, netns: tuple[str, str, str, str]
) -> None:
    ns, ns_if, host_addr, ns_addr = netns
    c = Cluster(tmp_path, host=host_addr)
    serf3 = None
    try:
        c.start("p1")
        c.start("p2")
        auth = tmp_path / "serf-rpc.key"  # the operator's Serf has an RPC key
        auth.write_text("p3-rpc-key\n")
        auth.chmod(0o600)
        serf3 = SerfProcess(
            "p3", bind=f"{ns_addr}:{free_port()}", rpc_addr=f"{ns_addr}:{free_port()}",
            join=[c.nodes["p1"].serf_bind], netns=ns, log_path=tmp_path / "serf-p3.log",
            auth_key="p3-rpc-key",
        )  # fmt: skip
        serf3.wait_ready().close()
        c.start("p3", serf_rpc=serf3.rpc_addr,
                extra_env={"DPUKV_CLUSTER_RPC_AUTH_FILE": str(auth)})  # fmt: skip
        names = ["p1", "p2", "p3"]
        c.wait_serving(names, on=names)
        _ip("-n", ns, "link", "set", ns_if, "down")  # the partition
        t0 = time.monotonic()
        c.wait_serving(["p1", "p2"], on=["p1", "p2"], timeout_s=60)
        failed_s = time.monotonic() - t0
        assert _status_on(c, "p1", "p3") in ("failed", "left")
        chunk = np.full(LAYOUT.chunk_shape, 3, np.float16)
        prompt = np.arange(16, dtype=np.uint32) + 77
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            r = kv.router
            assert r is not None
            assert r.refresh() and {n.name for n in r.placement.serving} == {"p1", "p2"}
            assert kv.put(prompt, [chunk]) == 1 and kv.lookup(prompt) == 1
        _ip("-n", ns, "link", "set", ns_if, "up")  # healed
        t1 = time.monotonic()
        c.wait_serving(names, on=names, timeout_s=90)
        back_s = time.monotonic() - t1
        print(f"partition: failed after {failed_s:.1f} s, back after {back_s:.1f} s")
    finally:
        c.stop_all()
        if serf3 is not None:
            serf3.kill()
