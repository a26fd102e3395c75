"""A partitioned node: its Serf agent lives in a network namespace this test makes (veth pair);
taking the link down makes the others mark it failed and route around it; link up, it is back.
The agent of that node uses the operator-run Serf path ([cluster] serf_start = false)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster, ip, secrets_env, veth_netns

from dpu_agent.cluster import SerfProcess, free_port
from host_shim import KVClient
from host_shim.client import ControlChannel, ControlError
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("cluster-part", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"cluster-part-salt-01234"
# What a client call may cost beyond the per-node deadline: one round trip, which on this
# shared two-core box (several test runs at once) is up to a few hundred ms of scheduling.
ROUND_TRIP_SLACK_S = 0.5


@pytest.fixture()
def netns() -> Iterator[tuple[str, str, str, str]]:
    with veth_netns("i13", 213) as n:
        yield n


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
            auth_key="p3-rpc-key", keyring_file=secrets_env(tmp_path, tmp_path / "p3")[
                "DPUKV_CLUSTER_KEYRING_FILE"],
        )  # fmt: skip
        serf3.wait_ready().close()
        c.start("p3", serf_rpc=serf3.rpc_addr,
                extra_env={"DPUKV_CLUSTER_RPC_AUTH_FILE": str(auth)})  # fmt: skip
        names = ["p1", "p2", "p3"]
        c.wait_serving(names, on=names)
        ip("-n", ns, "link", "set", ns_if, "down")  # the partition
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
        ip("-n", ns, "link", "set", ns_if, "up")  # healed
        t1 = time.monotonic()
        c.wait_serving(names, on=names, timeout_s=90)
        back_s = time.monotonic() - t1
        print(f"partition: failed after {failed_s:.1f} s, back after {back_s:.1f} s")
    finally:
        c.stop_all()
        if serf3 is not None:
            serf3.kill()


def _tc(ns: str | None, *args: str) -> None:
    cmd = ["tc", *args] if ns is None else ["ip", "netns", "exec", ns, "tc", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def _silent(ns: str, ns_if: str, host_if: str, on: bool) -> None:
    """Drop every packet both ways on the veth pair, silently (no RST, no ICMP): a root
    qdisc that holds nothing (pfifo limit 0) on each end. Off: the default qdisc again."""
    for where, dev in ((None, host_if), (ns, ns_if)):
        if on:
            _tc(where, "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0")
        else:
            _tc(where, "qdisc", "del", "dev", dev, "root")


def _cluster_view(url: str, token: str) -> dict:
    with ControlChannel(url, "default", token, timeout_s=5.0) as ch:
        ch.connect()
        return ch.call("members")


def _metric(ns: str, url: str, name: str) -> float | None:
    """A gauge of an agent whose metrics listen on the namespace's loopback."""
    code = (
        "import sys, urllib.request; "
        "print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, url],
                         capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    for line in out.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _timed_reads(kv: KVClient, idxs: list[int], times: list[float], bad: list[int]) -> None:
    out = [np.empty(LAYOUT.chunk_shape, np.float16)]
    for i in idxs:
        t0 = time.monotonic()
        got = kv.get(_prompt(i), out)
        times.append(time.monotonic() - t0)
        if got != 1 or out[0].tobytes() != _chunk(i).tobytes():
            bad.append(i)


def _prompt(i: int) -> np.ndarray:
    return np.arange(16, dtype=np.uint32) + 1_000_000 * (i + 1)


def _chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 1 << 16, LAYOUT.chunk_shape,
                                              dtype=np.uint16).view(np.float16)  # fmt: skip


def _p99_max(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * 0.99))], s[-1]


def _cut(ns: str, ns_if: str, host_if: str, mode: str, on: bool) -> None:
    if mode == "silent":
        _silent(ns, ns_if, host_if, on)
    else:  # the node's own link
        ip("-n", ns, "link", "set", ns_if, "down" if on else "up")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["silent", "link_down"])
def test_silent_drop_partition_costs_one_deadline_and_the_cut_off_node_says_so(
    tmp_path: Path, netns: tuple[str, str, str, str], mode: str
) -> None:
    """Regression (two findings): with a member's packets silently dropped, the first call
    touching it blocked 34-36 s and calls for other members' keys from another thread stalled
    up to 25 s; the cut-off member itself never said so and kept taking writes.

    p1 and p2 run on the host side of a veth pair, p3 (agent and Serf) inside the namespace;
    the partition drops every packet both ways. The client (R=2) must spend at most the
    per-node deadline plus a round trip on any call; p3 must report itself cut off (members,
    metrics, log) and refuse writes; after the heal everything converges. `link_down`: p3's
    own link goes down instead (it never dropped anyone in 39-60 s before)."""
    ns, ns_if, host_addr, ns_addr = netns
    host_if = "i13a" + ns.removeprefix("i13p")
    c = Cluster(tmp_path, replicas=2, host=host_addr)
    here = {"DPUKV_CONTROL_HOST": host_addr, "DPUKV_NVMF_HOST": host_addr}
    there = {"DPUKV_CONTROL_HOST": ns_addr, "DPUKV_NVMF_HOST": ns_addr,
             "DPUKV_METRICS_ENABLED": "1", "DPUKV_METRICS_HOST": "127.0.0.1"}  # fmt: skip
    partitioned = False
    try:
        c.start("p1", extra_env=here)
        c.start("p2", extra_env=here)
        c.start("p3", netns=ns, host=ns_addr, extra_env=there)
        names = ["p1", "p2", "p3"]
        c.wait_serving(names, on=names, timeout_s=60)
        p3 = c.nodes["p3"].agent
        # The deadline: 0.5 s, not the LAN default of 0.25 s: on this shared two-core box
        # with several test runs at once a live agent was seen silent for 0.25 s (marked down
        # for a probe interval: misses for keys whose other replica is p3, which this test
        # counts as failures). test_cluster_failures.py runs the default.
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1,
                      node_deadline_s=0.5) as kv:  # fmt: skip
            r = kv.router
            assert r is not None
            r.spread_hot_reads = False  # hot copies would make p3 an owner of every key
            assert r.refresh() and r.replicas == 2 and len(r.placement.serving) == 3
            n = 30
            assert all(kv.put(_prompt(i), [_chunk(i)]) == 1 for i in range(n))
            owners = {i: [o.name for o in r.placement.owners(kv.keys(_prompt(i))[0], 2)]
                      for i in range(n)}  # fmt: skip
            on_p3 = [i for i in range(n) if owners[i][0] == "p3"]
            elsewhere = [i for i in range(n) if "p3" not in owners[i]]
            assert on_p3 and elsewhere, owners
            warm: list[float] = []
            _timed_reads(kv, list(range(n)), warm, [])  # connected to every member
            assert not _cluster_view(p3.unix_url, c.token)["reach"]["cut_off"]

            other_times: list[float] = []
            other_bad: list[int] = []
            stop = threading.Event()

            def other_thread() -> None:
                while not stop.is_set():
                    _timed_reads(kv, elsewhere, other_times, other_bad)

            t = threading.Thread(target=other_thread)
            t.start()
            times: list[float] = []
            bad: list[int] = []
            try:
                time.sleep(0.3)
                _cut(ns, ns_if, host_if, mode, True)
                partitioned = True
                t0 = time.monotonic()
                cut_s = None
                while time.monotonic() - t0 < 12:  # reads go on through the partition
                    _timed_reads(kv, on_p3, times, bad)
                    if cut_s is None and _cluster_view(p3.unix_url, c.token)["reach"]["cut_off"]:
                        cut_s = time.monotonic() - t0
            finally:
                stop.set()
                t.join(timeout=30)
            p99, worst = _p99_max(times)
            op99, oworst = _p99_max(other_times)
            deadline = r.deadline_s
            print(f"{mode} partition: p3's keys {len(times)} gets p99 {p99 * 1e3:.1f} ms "
                  f"max {worst * 1e3:.1f} ms; other thread {len(other_times)} gets p99 "
                  f"{op99 * 1e3:.1f} ms max {oworst * 1e3:.1f} ms; deadline "
                  f"{deadline * 1e3:.0f} ms; p3 cut off after {cut_s} s")  # fmt: skip
            assert not bad and not other_bad, (bad, other_bad)  # R=2: the other replica
            assert worst <= deadline + ROUND_TRIP_SLACK_S, worst
            assert oworst <= deadline + ROUND_TRIP_SLACK_S, oworst
            assert "p3" in r.down() or "p3" not in {m.name for m in r.placement.serving}

            # the cut-off node says so: members/status, metrics, log; it refuses writes
            view = _cluster_view(p3.unix_url, c.token)
            assert cut_s is not None and view["reach"]["cut_off"], view["reach"]
            assert view["reach"]["reached"] == 1 and view["reach"]["known"] == 3
            assert not _cluster_view(c.nodes["p1"].agent.control_url, c.token)["reach"]["cut_off"]
            assert _metric(ns, p3.metrics_url, "kvtier_cluster_cut_off") == 1.0
            assert "cluster_cut_off" in (p3.data_dir / "agent.log").read_text()
            with ControlChannel(p3.unix_url, "default", c.token, timeout_s=5.0) as ch:
                ch.connect()
                with pytest.raises(ControlError) as refused:
                    ch.call("reserve", key=kv.keys(_prompt(99))[0], length=4096,
                            epoch=view["epoch"])  # fmt: skip
                assert refused.value.code == "unavailable"

            _cut(ns, ns_if, host_if, mode, False)  # healed
            partitioned = False
            t1 = time.monotonic()
            c.wait_serving(names, on=names, timeout_s=90)
            deadline_at = time.monotonic() + 30
            while _cluster_view(p3.unix_url, c.token)["reach"]["cut_off"] or r.down():
                assert time.monotonic() < deadline_at, (r.down(), "p3 still cut off?")
                time.sleep(0.2)
            print(f"healed: converged after {time.monotonic() - t1:.1f} s")
            assert r.refresh() and len(r.placement.serving) == 3
            after: list[float] = []
            missed: list[int] = []
            _timed_reads(kv, list(range(n)), after, missed)
            assert not missed, missed
    finally:
        if partitioned:
            _cut(ns, ns_if, host_if, mode, False)
        c.stop_all()
