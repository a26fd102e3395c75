"""`dpuctl bench cluster --real`'s partition: real agents (each with its Serf child) in network
namespaces the bench makes, all joined through one bridge in a bridge namespace; the bench's
clients sit in this namespace, on one more port of that bridge. One node is black-holed in the
bridge namespace (its bridge port set `disabled`: every frame to and from it is dropped, no
RST, no ICMP, its own link stays up) while client threads read at R=2: every call's latency,
the calls over the per-node deadline plus one round trip, misses, the reads of the cut node's
keys the other replica served, how long until the cut node says it is cut off; then the heal
and the time until every agent and the client see every node serving again.

Needs root, iproute2 (`ip`, `bridge`) and serf; every namespace, link and process it made is
removed in a `finally`.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PARTITION_NODES_MAX", "partition_unavailable", "run_partition"]

PARTITION_NODES_MAX = 5  # agents at once on this 2-core machine next to the Serf-only figures
PARTITION_CHUNKS = 60  # keys read during the cut: ~2/5 have the cut node as an owner at N=5
PARTITION_READERS = 4  # client threads: a call must not wait on another thread's dead node
WARM_S = 2.0  # reads before the cut: the healthy round trip, every node connected
CUT_S = 10.0  # the cut lasts past Serf's failure detection (~5-8 s at N <= 5)
HEAL_WAIT_S = 120.0  # a heal not converged in two minutes is a failure, not a figure
SAMPLES_MAX = 200_000  # latencies kept (four threads for ~15 s at most ~1 ms a call)
POLL_S = 0.2
PUT_TRIES_MAX = 5  # a chunk not stored after five tries is left out (and not read)
SUBNET_OCTET = 252  # 10.252.X.0/24, X random: apart from the tests' 10.213/10.214 nets


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def partition_unavailable() -> str:
    """Why the partition cannot run here ("" when it can)."""
    import os

    missing = [t for t in ("ip", "bridge", "serf") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    return ""


@dataclass
class _Lab:
    tag: str
    bridge_ns: str
    net: str  # "10.252.X"
    host_if: str
    nodes: list[tuple[str, str, str]] = field(default_factory=list)  # (netns, port, addr)

    def cut(self, i: int, on: bool) -> None:
        """Node `i`'s bridge port disabled (silent drop both ways) or forwarding again."""
        subprocess.run(["bridge", "-n", self.bridge_ns, "link", "set", "dev", self.nodes[i][1],
                        "state", "0" if on else "3"],
                       check=True, capture_output=True, timeout=10)  # fmt: skip


@contextlib.contextmanager
def _bridge_lab(n: int) -> Iterator[_Lab]:
    tag = secrets.token_hex(3)
    net = f"10.{SUBNET_OCTET}.{int(tag[:2], 16)}"
    lab = _Lab(tag, f"kvbb{tag}", net, f"kvbh{tag}")
    made: list[str] = []
    try:
        _ip("netns", "add", lab.bridge_ns)
        made.append(lab.bridge_ns)
        b = ("-n", lab.bridge_ns)
        _ip(*b, "link", "add", "br0", "type", "bridge")
        _ip(*b, "link", "set", "br0", "up")
        _ip("link", "add", lab.host_if, "type", "veth", "peer", "name", f"kvbH{tag}")
        _ip("link", "set", f"kvbH{tag}", "netns", lab.bridge_ns)
        _ip(*b, "link", "set", f"kvbH{tag}", "master", "br0")
        _ip(*b, "link", "set", f"kvbH{tag}", "up")
        _ip("addr", "add", f"{net}.1/24", "dev", lab.host_if)
        _ip("link", "set", lab.host_if, "up")
        for i in range(n):
            ns, port, inner, addr = (
                f"kvbn{i}{tag}",
                f"kvbp{i}{tag}",
                f"kvbq{i}{tag}",
                f"{net}.{10 + i}",
            )
            _ip("netns", "add", ns)
            made.append(ns)
            _ip(*b, "link", "add", port, "type", "veth", "peer", "name", inner)
            _ip(*b, "link", "set", inner, "netns", ns)
            _ip(*b, "link", "set", port, "master", "br0")
            _ip(*b, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            lab.nodes.append((ns, port, addr))
        yield lab
    finally:
        subprocess.run(["ip", "link", "del", lab.host_if], capture_output=True, timeout=10)
        for ns in reversed(made):  # deleting a namespace deletes the links inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _put(kv: Any, prompt: np.ndarray, chunk: np.ndarray) -> bool:
    """Store one chunk; a put that stored nothing (a member starved past the deadline on a
    loaded box) is tried again, PUT_TRIES_MAX times in all."""
    for _ in range(PUT_TRIES_MAX):
        if kv.put(prompt, [chunk]) == 1:
            return True
        time.sleep(POLL_S)
    return False


def _pct(s: list[float], q: float) -> float:
    return round(float(np.percentile(s, q)) * 1e3, 2) if s else 0.0


def run_partition(
    nodes: int, replicas: int = 2, node_deadline_s: float | None = None
) -> dict[str, Any]:
    """See the module docstring. `nodes` agents (at most PARTITION_NODES_MAX), R=`replicas`,
    the clients' per-node deadline `node_deadline_s` (None: host_shim's default)."""
    from dpu_agent.bench.cluster import cluster_files, settled
    from dpu_agent.cluster._serf_process import PICK_PORT_RANGE
    from dpu_agent.testing import spawn_agent
    from host_shim import KVClient
    from host_shim.client import ControlChannel, ControlError
    from kvproto.keys import ChunkLayout

    why = partition_unavailable()
    if why:
        return {"partition_skipped": why}
    n = max(3, min(nodes, PARTITION_NODES_MAX))
    replicas = max(2, replicas)
    layout = ChunkLayout("bench-partition", "uint8", 1, 1, 1024, chunk_tokens=1)
    salt = b"bench-cluster-partition-salt"
    agents: list[Any] = []
    lo, hi = PICK_PORT_RANGE  # nothing else binds in the namespaces made here
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-part-") as d, _bridge_lab(n) as lab:
        files = cluster_files(d)
        victim = n - 1
        cut = False
        try:
            rng_port = np.random.default_rng()
            binds: list[str] = []
            for i, (ns, _port, addr) in enumerate(lab.nodes):
                bind = f"{addr}:{int(rng_port.integers(lo, hi))}"  # a namespace of its own
                env = {
                    **files.env(f"q{i}"), "DPUKV_CLUSTER_SERF_BIND": bind,
                    "DPUKV_CLUSTER_SERF_RPC": f"{addr}:{int(rng_port.integers(lo, hi))}",
                    "DPUKV_CLUSTER_JOIN": ",".join(binds[:2]),
                    "DPUKV_CLUSTER_REPLICAS": str(replicas),
                    "DPUKV_CONTROL_HOST": addr, "DPUKV_NVMF_HOST": addr,
                }  # fmt: skip
                agents.append(spawn_agent(f"{d}/q{i}", env=env, config=files.config, netns=ns))
                binds.append(bind)
            deadline = time.monotonic() + HEAL_WAIT_S
            while time.monotonic() < deadline and not settled(agents, files.token, n):
                time.sleep(POLL_S)
            seeds = ",".join(a.control_url for a in agents)
            with KVClient(seeds, "default", files.token, layout, salt, io_queues=1,
                          node_deadline_s=node_deadline_s) as kv:  # fmt: skip
                r = kv.router
                assert r is not None
                r.spread_hot_reads = False  # hot copies would make the cut node own every key
                t_wait = time.monotonic() + HEAL_WAIT_S
                while not (r.refresh() and len(r.placement.serving) == n):
                    if time.monotonic() > t_wait:
                        raise TimeoutError(f"the client did not see {n} serving members")
                    time.sleep(POLL_S)
                rng = np.random.default_rng(5)
                data = [rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8)
                        for _ in range(PARTITION_CHUNKS)]  # fmt: skip
                prompts = [np.array([i + 1], dtype=np.uint32) for i in range(PARTITION_CHUNKS)]
                held = [i for i in range(PARTITION_CHUNKS) if _put(kv, prompts[i], data[i])]
                if not held:
                    raise RuntimeError("no chunk could be stored before the partition")
                stored = len(held)
                name = f"q{victim}"
                on_victim = {i for i, p in enumerate(prompts)
                             if name in {o.name for o in r.placement.owners(kv.keys(p)[0],
                                                                            replicas)}}  # fmt: skip
                calls: list[tuple[float, float, int, bool]] = []
                stop = threading.Event()

                def reader(seed: int) -> None:
                    g = np.random.default_rng(seed)
                    out = [np.empty(layout.chunk_bytes, np.uint8)]
                    while not stop.is_set() and len(calls) < SAMPLES_MAX:
                        i = held[int(g.integers(0, len(held)))]
                        t0 = time.monotonic()
                        try:
                            got = kv.get(prompts[i], out)
                        except (ControlError, OSError):
                            got = 0
                        ok = got == 1 and out[0].tobytes() == data[i].tobytes()
                        calls.append((t0, time.monotonic() - t0, i, ok))

                threads = [threading.Thread(target=reader, args=(s,), daemon=True)
                           for s in range(PARTITION_READERS)]  # fmt: skip
                for t in threads:
                    t.start()
                time.sleep(WARM_S)
                lab.cut(victim, True)
                cut, t_cut = True, time.monotonic()
                said_cut_off = None
                while time.monotonic() - t_cut < CUT_S:
                    if said_cut_off is None:
                        with contextlib.suppress(ControlError, OSError):
                            with ControlChannel(agents[victim].unix_url, "default",
                                                files.token, timeout_s=2.0) as ch:  # fmt: skip
                                ch.connect()
                                if ch.call("members")["reach"]["cut_off"]:
                                    said_cut_off = time.monotonic() - t_cut
                    time.sleep(POLL_S)
                t_heal = time.monotonic()
                stop.set()
                for t in threads:
                    t.join(timeout=30)
                down_seen = name in r.down() or name not in {x.name for x in r.placement.serving}
                lab.cut(victim, False)
                cut = False
                deadline = time.monotonic() + HEAL_WAIT_S
                while not settled(agents, files.token, n) or r.down():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the heal did not converge in {HEAL_WAIT_S} s")
                    time.sleep(POLL_S)
                heal_s = time.monotonic() - t_heal
                out = [np.empty(layout.chunk_bytes, np.uint8)]
                r.refresh()
                after_miss = sum(
                    kv.get(prompts[i], out) != 1 or out[0].tobytes() != data[i].tobytes()
                    for i in held
                )  # fmt: skip
                deadline_s = r.deadline_s
        finally:
            if cut:
                lab.cut(victim, False)
            for a in agents:
                a.stop(timeout_s=20)
    warm = [c[1] for c in calls if c[0] < t_cut]
    during = [c for c in calls if t_cut <= c[0] < t_heal]
    lat = [c[1] for c in during]
    rtt = float(np.median(warm)) if warm else 0.0
    bound = deadline_s + rtt
    victim_reads = [c for c in during if c[2] in on_victim]
    return {
        "partition_nodes": n, "partition_replicas": replicas, "partition_chunks": stored,
        "partition_readers": PARTITION_READERS, "partition_cut_s": CUT_S,
        "partition_how": "bridge port disabled in the bridge namespace (silent drop, no RST)",
        "node_deadline_ms": round(deadline_s * 1e3, 1),
        "round_trip_ms_p50_before": round(rtt * 1e3, 2),
        "partition_calls": len(during),
        "partition_call_ms_p50": _pct(lat, 50), "partition_call_ms_p99": _pct(lat, 99),
        "partition_call_ms_max": _pct(lat, 100),
        "partition_calls_over_deadline_plus_rtt": sum(x > bound for x in lat),
        "partition_misses": sum(not c[3] for c in during),
        "partition_reads_of_cut_node_keys": len(victim_reads),
        "partition_served_by_other_replica": sum(c[3] for c in victim_reads),
        "partition_client_marked_cut_node_down": down_seen,
        "cut_node_says_cut_off_s": None if said_cut_off is None else round(said_cut_off, 2),
        "heal_converged_s": round(heal_s, 2),
        "heal_misses": after_miss,
    }  # fmt: skip
