"""`dpuctl bench cluster`: placement and membership at scale, simulated and measured.

--simulate --nodes N: the placement code itself (kvproto.placement) over N simulated
members and `--keys` random chunk keys: the fraction of keys that move when a node joins or
leaves (against the ideal 1/N), max/mean load with equal weights, and the time until every
node knows a change from a gossip model of Serf's LAN profile (memberlist: every 200 ms each
node sends its pending broadcasts to 3 random members, each broadcast retransmitted
4 x ceil(log10(N+1)) times), with an offset calibrated on real Serf
runs here (CALIBRATION, from `--real`). Failure detection follows memberlist's suspicion
timeout, 4 x log10(N) x the 1 s probe interval, plus a calibrated offset.

--real --nodes N: N live `serf agent` processes on loopback, with the tags agents publish:
join, tag-change and graceful-leave propagation until every agent's `members` shows it,
kill -9 until every agent shows `failed`, and the moved fractions of the member lists they
report, through the same placement code; a join's moved bytes against the ideal on up to
MOVE_NODES_MAX real agents at R=--replicas; view-change CPU per million chunks; and a silent-drop
partition of one of up to 5 real agents in network namespaces (bench/cluster_partition.py).
"""

from __future__ import annotations

import base64
import json
import math
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
import msgpack
import numpy as np

from dpu_agent.cluster import SerfClient, SerfProcess, free_port, node_of, plan
from dpu_agent.cluster._views import ViewHistory
from kvproto.control import Reply, encode_reply
from kvproto.peer_auth import AUTH_TAG, member_tag
from kvproto.placement import Node, Placement

__all__ = [
    "ClusterFiles",
    "cluster_cmd",
    "cluster_files",
    "gossip_rounds",
    "run_real",
    "run_simulation",
    "settled",
]

NODES_MAX = 4096  # simulated; the design's target is 1,024
REAL_NODES_MAX = 64  # live Serf agents on this 2-core machine (~15 MB and ~0.2% CPU each)
KEYS_MAX = 8 << 20
VIEW_KEYS = 1 << 20  # held chunks whose view-change planning is timed (the per-million base)
VIEW_REPLICAS = 2
MOVE_NODES_MAX = 6  # real agents (engine, NVMe/TCP, Serf each) for the moved-bytes figure
MOVE_CHUNKS = 240  # 2 KiB chunks put before the join: ~100 KiB move into the joiner
KEYS_PER_NODE = 2048  # max/mean load's sampling noise ~ 3.7/sqrt(2048) = 8% at 1,024 nodes
TRIALS_MAX = 1000
POLL_S = 0.02
WAIT_S_MAX = 60.0  # a change not seen everywhere in a minute is a failure, not a figure

# memberlist's LAN defaults (Serf's default profile)
GOSSIP_INTERVAL_S = 0.2
GOSSIP_NODES = 3
RETRANSMIT_MULT = 4
PROBE_INTERVAL_S = 1.0
SUSPICION_MULT = 4
# Fitted on `dpuctl bench cluster --real --nodes 8/16/32 --trials 12` on this machine
# (docs/BENCHMARKS.md, Cluster): real tag-change propagation p50 0.372/0.429/0.569 s against
# the model's mean rounds 2.9/3.7/4.5: least squares gives seconds = 0.62 x rounds x 0.2 s
# (offset ~0; memberlist sends a broadcast at once and piggybacks it on probes, so it beats
# the 200 ms tick). Failure detection 5.96/7.72/10.22 s against suspicion timeouts of
# 3.6/4.8/6.0 s: +3.1 s on average (probe round, indirect probes, the dead message's gossip).
CALIBRATION = {"propagation_scale": 0.62, "propagation_offset_s": 0.0, "failure_offset_s": 3.1}
# memberlist's full state exchange (push-pull, TCP) with one random member: every 30 s on the
# LAN profile up to 32 members, then slower as the cluster grows so that the exchanges do not
# saturate the network (memberlist util.go pushPullScale: x(ceil(log2 n - log2 32) + 1)).
PUSH_PULL_INTERVAL_S = 30.0
PUSH_PULL_SCALE_THRESHOLD = 32


def push_pull_interval_s(n: int) -> float:
    """Seconds between one member's push-pull exchanges in a cluster of `n` (memberlist)."""
    if n <= PUSH_PULL_SCALE_THRESHOLD:
        return PUSH_PULL_INTERVAL_S
    mult = math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1
    return mult * PUSH_PULL_INTERVAL_S


def push_pull_bytes(n: int) -> dict[str, Any]:
    """What push-pull costs at `n` members with this project's tags: the full state one
    exchange carries (each member as memberlist encodes it: name, address, port, the tags
    Serf packs into its meta, incarnation, state, versions), and per member per second."""
    members = []
    for i in range(n):
        name = f"dpu-{i:05d}.rack-{i // 32:03d}"
        meta = msgpack.packb(_tags(name, i))
        members.append({"Name": name, "Addr": bytes(16), "Port": 7946, "Meta": meta,
                        "Incarnation": 1, "State": 0, "Vsn": [1, 5, 2, 2, 5, 4]})  # fmt: skip
    state = len(msgpack.packb(members))
    interval = push_pull_interval_s(n)
    return {
        "push_pull_interval_s": interval,
        "push_pull_state_bytes": state,
        # each member starts one exchange per interval and answers one on average: both ways
        "push_pull_bytes_per_member_per_s": round(4 * state / interval),
    }


def gossip_rounds(n: int, rng: np.random.Generator) -> int:
    """Gossip rounds until all `n` nodes hold a broadcast that starts at one node; a node
    never reached by gossip gets it at the next push-pull (push_pull_interval_s(n) of rounds)."""
    limit = RETRANSMIT_MULT * max(1, math.ceil(math.log10(n + 1)))
    informed = np.zeros(n, dtype=bool)
    budget = np.zeros(n, dtype=np.int64)
    informed[0], budget[0] = True, limit
    for rounds in range(1, 10_000):
        senders = np.flatnonzero(budget > 0)
        if not len(senders):
            break
        budget[senders] -= 1
        targets = rng.integers(0, n, size=(len(senders), GOSSIP_NODES)).ravel()
        new = targets[~informed[targets]]
        informed[new] = True
        budget[new] = limit
        if informed.all():
            return rounds
    return int(push_pull_interval_s(n) / GOSSIP_INTERVAL_S)  # residue: the next push-pull


def _model_s(rounds: np.ndarray) -> np.ndarray:
    c = CALIBRATION
    return c["propagation_offset_s"] + c["propagation_scale"] * rounds * GOSSIP_INTERVAL_S


def _failure_model_s(nodes: int) -> float:
    suspicion = SUSPICION_MULT * math.log10(max(nodes, 2)) * PROBE_INTERVAL_S
    return suspicion + CALIBRATION["failure_offset_s"]


def _moved(before: Placement, after: Placement, k64: np.ndarray) -> float:
    a = np.array([n.name for n in before.serving])[before.primary_index(k64)]
    b = np.array([n.name for n in after.serving])[after.primary_index(k64)]
    return float(np.mean(a != b))


def _placement_figures(nodes: list[Node], k64: np.ndarray) -> dict[str, Any]:
    n = len(nodes)
    base = Placement(nodes)
    idx = base.primary_index(k64)
    load = np.bincount(idx, minlength=n)
    joined = Placement([*nodes, Node(name="joining-node")])
    left = Placement(nodes[1:])
    mj, ml = _moved(base, joined, k64), _moved(base, left, k64)
    return {
        "moved_fraction_join": round(mj, 6),
        "moved_fraction_join_ideal": round(1 / (n + 1), 6),
        "moved_join_over_ideal": round(mj * (n + 1), 3),
        "moved_fraction_leave": round(ml, 6),
        "moved_fraction_leave_ideal": round(1 / n, 6),
        "moved_leave_over_ideal": round(ml * n, 3),
        "max_over_mean_load": round(float(load.max() / load.mean()), 4),
    }


def view_change_cpu(nodes: int, replicas: int, keys: int = VIEW_KEYS) -> dict[str, Any]:
    """CPU seconds per million held chunks to work out what a view change moves
    (dpu_agent.cluster._plan: one hash column per joined node, full ranking only for the keys
    whose owners changed), against ranking every key under both views (what a pass did
    before). Equal weights, no zones (weighted or zoned views rank everything)."""
    k64 = np.random.default_rng(7).integers(0, 1 << 63, size=keys, dtype=np.uint64)
    base = Placement([Node(name=f"node-{i:05d}") for i in range(nodes)])
    joined = Placement([*base.serving, Node(name="joining-node")])
    left = Placement(base.serving[1:])
    r = min(replicas, nodes)
    table = plan(k64, r, base, None, None).table
    per_m = 1e6 / keys
    out: dict[str, Any] = {}
    for what, new in (("join", joined), ("leave", left)):
        t0 = time.process_time()
        p = plan(k64, r, new, base, table)
        out[f"view_change_cpu_s_per_million_{what}"] = round((time.process_time() - t0) * per_m, 4)
        out[f"view_change_ranked_fraction_{what}"] = round(p.ranked / keys, 6)
    t0 = time.process_time()
    base.owner_index(k64, r)
    joined.owner_index(k64, r)
    out["full_rank_cpu_s_per_million"] = round((time.process_time() - t0) * per_m, 4)
    return out


def run_simulation(
    nodes: int, keys: int, trials: int, seed: int = 1, replicas: int = VIEW_REPLICAS
) -> dict[str, Any]:
    if not 2 <= nodes <= NODES_MAX:
        raise click.BadParameter(f"--nodes {nodes}: give 2..{NODES_MAX}")
    keys = keys or min(KEYS_MAX, max(1 << 16, KEYS_PER_NODE * nodes))
    if not 1 <= keys <= KEYS_MAX or not 1 <= trials <= TRIALS_MAX:
        raise click.BadParameter(f"--keys 1..{KEYS_MAX}, --trials 1..{TRIALS_MAX}")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    k64 = rng.integers(0, 1 << 63, size=keys, dtype=np.int64).astype(np.uint64)
    figures = _placement_figures([Node(name=f"node-{i:05d}") for i in range(nodes)], k64)
    rounds = np.array([gossip_rounds(nodes, rng) for _ in range(trials)])
    conv = _model_s(rounds)
    return {
        "bench": "cluster", "mode": "simulate", "nodes": nodes, "keys": keys, "trials": trials,
        **figures,
        "gossip_rounds_p50": float(np.percentile(rounds, 50)),
        "gossip_rounds_p99": float(np.percentile(rounds, 99)),
        "convergence_s_p50": round(float(np.percentile(conv, 50)), 3),
        "convergence_s_p99": round(float(np.percentile(conv, 99)), 3),
        "failure_detect_s": round(_failure_model_s(nodes), 2),
        **refresh_bytes(nodes),
        **push_pull_bytes(nodes),
        **view_change_cpu(nodes, replicas),
        "calibration": CALIBRATION,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }  # fmt: skip


def _row(i: int) -> dict[str, Any]:
    """A member's row in `members`, with addresses as long as a real /16 deployment's."""
    ip = f"10.{i >> 8 & 255}.{i & 255}"
    return {"name": f"dpu-{i:05d}.rack-{i // 32:03d}", "status": "alive", "state": "serving",
            "control": f"tcp://{ip}.2:7400", "nvme": f"{ip}.2:4420",
            "capacity_bytes": 4 << 40, "zone": f"rack-{i // 32:03d}",
            "serf": f"{ip}.2:7946"}  # fmt: skip


def refresh_bytes(nodes: int) -> dict[str, int]:
    """Bytes of one client's member-list refresh as the agent frames it (kvproto.control):
    the whole list, `members since=EPOCH` when nothing changed, and after one join."""
    rows = [_row(i) for i in range(nodes)]
    h = ViewHistory()
    h.remember(rows, 1)
    extras = {"epoch": 2, "since": 1, "serving": nodes, "replicas": 2, "node": rows[0]["name"]}

    def framed(result: dict[str, Any]) -> int:
        return len(encode_reply(Reply(id=1, ok=True, result=result)))

    joined = [*rows, _row(nodes)]
    return {
        "refresh_full_bytes": framed({"members": rows, **extras, "epoch": 1}),
        "refresh_unchanged_bytes": framed({**(h.delta(rows, 1, 1) or {}), **extras,
                                           "epoch": 1}),
        "refresh_one_join_bytes": framed({**(h.delta(joined, 2, 1) or {}), **extras}),
    }  # fmt: skip


# --- live agents: a join's moved bytes -------------------------------------------------------


@dataclass
class ClusterFiles:
    """A bench cluster's shared files under `root`: the tenant token and config, one gossip
    key and one peer key (docs/CLUSTER.md, Keys), copied 0600 into each node's data dir."""

    root: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    gossip: str = field(
        default_factory=lambda: json.dumps([base64.b64encode(secrets.token_bytes(32)).decode()])
    )
    peer_key: str = field(
        default_factory=lambda: base64.b64encode(secrets.token_bytes(32)).decode() + "\n"
    )

    @property
    def config(self) -> str:
        return f"{self.root}/cluster.toml"

    def write(self) -> ClusterFiles:
        _secret(f"{self.root}/default.token", self.token + "\n")
        with open(self.config, "w") as f:
            f.write(f'[tenants.default]\ntoken_file = "{self.root}/default.token"\n')
        return self

    def env(self, name: str) -> dict[str, str]:
        """Node `name`'s secrets in its data dir and the env every bench node shares."""
        os.makedirs(f"{self.root}/{name}", exist_ok=True)
        _secret(f"{self.root}/{name}/serf-keyring.json", self.gossip)
        _secret(f"{self.root}/{name}/cluster-peer.key", self.peer_key)
        return {
            "DPUKV_AGENT_NODE_NAME": name, "DPUKV_CLUSTER_ENABLED": "1",
            "DPUKV_CLUSTER_REFRESH_INTERVAL_S": "1", "DPUKV_METRICS_ENABLED": "0",
            "DPUKV_STORAGE_DRAM_BYTES": str(16 << 20),
            "DPUKV_STORAGE_NVME_BYTES": str(64 << 20),
        }  # fmt: skip


def _secret(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def cluster_files(root: str) -> ClusterFiles:
    return ClusterFiles(root).write()


def run_moves(nodes: int, replicas: int, chunks: int = MOVE_CHUNKS) -> dict[str, Any]:
    """`nodes` real agents (each with its Serf child) at R=`replicas`; `chunks` 2 KiB chunks
    put through a cluster client; one more agent joins: the bytes written to other nodes by
    every rebalancer, against the ideal (the chunks the joiner now owns), and the drain time."""
    from dpu_agent.testing import spawn_agent
    from host_shim import KVClient
    from kvproto.keys import ChunkLayout

    nodes = max(2, min(nodes, MOVE_NODES_MAX))
    layout = ChunkLayout("bench-moves", "uint8", 1, 1, 1024, chunk_tokens=1)  # 2 KiB (K and V)
    salt = b"bench-cluster-moves-salt"
    agents: list[Any] = []
    binds: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-moves-") as d:
        files = cluster_files(d)
        token = files.token

        def start(i: int) -> None:
            bind = f"127.0.0.1:{free_port()}"
            env = {
                **files.env(f"m{i}"), "DPUKV_CLUSTER_SERF_BIND": bind,
                "DPUKV_CLUSTER_SERF_RPC": f"127.0.0.1:{free_port()}",
                "DPUKV_CLUSTER_JOIN": ",".join(binds[:2]),
                "DPUKV_CLUSTER_REPLICAS": str(replicas),
            }  # fmt: skip
            agents.append(spawn_agent(f"{d}/m{i}", env=env, config=files.config))
            binds.append(bind)

        try:
            for i in range(nodes):
                start(i)
            seeds = ",".join(a.control_url for a in agents)
            kv: Any = KVClient(seeds, "default", token, layout, salt, io_queues=1)
            with kv:
                _wait_members(kv, nodes)
                deadline = time.monotonic() + WAIT_S_MAX  # every agent on one epoch first
                while time.monotonic() < deadline and not settled(agents, token, nodes):
                    time.sleep(0.2)
                rng = np.random.default_rng(3)
                for i in range(chunks):
                    data = rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8)
                    kv.put(np.array([i + 1], dtype=np.uint32), [data])
                moved0 = sum(_rebalance(a, token)["moved_bytes"] for a in agents)
                t0 = time.monotonic()
                start(nodes)
                deadline = time.monotonic() + WAIT_S_MAX * 4
                while time.monotonic() < deadline and not settled(agents, token, nodes + 1):
                    time.sleep(0.2)
                drain_s = time.monotonic() - t0
                _wait_members(kv, nodes + 1)
                keys = [kv.keys(np.array([i + 1], dtype=np.uint32))[0] for i in range(chunks)]
                owned = sum(f"m{nodes}" in {n.name for n in kv.router.placement.owners(k, replicas)}
                            for k in keys)  # fmt: skip
            moved = sum(_rebalance(a, token)["moved_bytes"] for a in agents) - moved0
        finally:
            for a in agents:
                a.stop(timeout_s=20)
    ideal = owned * layout.chunk_bytes
    return {
        "move_nodes": nodes, "move_replicas": replicas, "move_chunks": chunks,
        "moved_bytes_join": moved, "moved_bytes_join_ideal": ideal,
        "moved_bytes_over_ideal": round(moved / ideal, 3) if ideal else None,
        "join_drain_s": round(drain_s, 2),
    }  # fmt: skip


def _rebalance(agent: Any, token: str) -> dict[str, Any]:
    from host_shim.client import ControlChannel

    with ControlChannel(agent.control_url, "default", token, timeout_s=5.0) as ch:
        ch.connect()
        return dict(ch.call("members")["rebalance"])


def settled(agents: list[Any], token: str, n: int) -> bool:
    from host_shim.client import ControlChannel, ControlError

    try:
        views = []
        for a in agents:
            with ControlChannel(a.control_url, "default", token, timeout_s=5.0) as ch:
                ch.connect()
                views.append(ch.call("members"))
    except (ControlError, OSError):
        return False
    return len({v["epoch"] for v in views}) == 1 and all(
        v["serving"] == n and not v["rebalance"]["running"] and v["rebalance"]["pending"] == 0
        and v["rebalance"]["epoch"] == v["epoch"] for v in views
    )  # fmt: skip


def _wait_members(kv: Any, n: int) -> None:
    deadline = time.monotonic() + WAIT_S_MAX
    while time.monotonic() < deadline:
        if kv.router.refresh() and len(kv.router.placement.serving) == n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the cluster client did not see {n} serving members in {WAIT_S_MAX} s")


# --- live Serf agents -----------------------------------------------------------------------


# The bench's own cluster key: its members sign their tags as real agents do (node_of
# places only members whose auth tag verifies).
_BENCH_KEYS = (b"dpukv-bench-cluster-key-not-a-secret-0000",)


def _tags(name: str, i: int) -> dict[str, str]:
    tags = {"kv": "1", "ctl": f"tcp://127.0.0.1:{7400 + i}", "nvme": f"127.0.0.1:{4420 + i}",
            "cap": str(1 << 30), "zone": ""}  # fmt: skip
    return {**tags, AUTH_TAG: member_tag(_BENCH_KEYS[0], name, tags), "state": "serving"}


def _wait_all(clients: list[SerfClient], seen: Callable[[SerfClient], bool]) -> float:
    """Seconds until `seen(c)` holds for every client (polled); TimeoutError after WAIT_S_MAX."""
    t0 = time.monotonic()
    pending = list(clients)
    while pending:
        pending = [c for c in pending if not seen(c)]
        if time.monotonic() - t0 > WAIT_S_MAX:
            raise TimeoutError(f"{len(pending)} agents did not see the change in {WAIT_S_MAX} s")
        if pending:
            time.sleep(POLL_S)
    return time.monotonic() - t0


def _has_probe(name: str, probe: str) -> Callable[[SerfClient], bool]:
    def seen(c: SerfClient) -> bool:
        return any(m.name == name and m.tags.get("probe") == probe for m in c.members())

    return seen


def _status(c: SerfClient, name: str) -> str:
    return next((m.status for m in c.members() if m.name == name), "")


def run_real(
    nodes: int, trials: int, keys: int = 1 << 18, *, replicas: int = VIEW_REPLICAS,
    moves: bool = True, partition: bool = True, node_deadline_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    if not 2 <= nodes <= REAL_NODES_MAX:
        raise click.BadParameter(f"--real --nodes {nodes}: give 2..{REAL_NODES_MAX}")
    trials = max(1, min(trials, 20))
    procs: list[SerfProcess] = []
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-serf-") as d:
        try:
            report = _real(nodes, trials, keys, procs, d)
        finally:
            for p in procs:
                p.kill()
    report.update(view_change_cpu(nodes, replicas))
    if moves:
        report.update(run_moves(nodes, replicas))
    if partition:
        from dpu_agent.bench.cluster_partition import run_partition

        report.update(run_partition(nodes, replicas, node_deadline_s))
    return report


def _start(name: str, i: int, seed: str, d: str) -> SerfProcess:
    bind, rpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    join = [seed] if seed else []
    return SerfProcess(name, bind=bind, rpc_addr=rpc, tags=_tags(name, i), join=join,
                       log_path=f"{d}/{name}.log")  # fmt: skip


def _real(nodes: int, trials: int, keys: int, procs: list[SerfProcess], d: str) -> dict[str, Any]:
    t_start = time.perf_counter()
    procs.append(_start("serf-000", 0, "", d))
    seed = procs[0].bind
    procs += [_start(f"serf-{i:03d}", i, seed, d) for i in range(1, nodes)]
    clients = [p.wait_ready() for p in procs]
    _wait_all(clients, lambda c: sum(m.status == "alive" for m in c.members()) == nodes)
    conv: list[float] = []
    for t in range(trials):  # a tag change on one node until every node's members shows it
        name = procs[t % nodes].node
        t0 = time.monotonic()  # before the call: Serf's tags RPC returns once gossip is sent
        clients[t % nodes].tags({"probe": f"z{t}"})
        _wait_all(clients, _has_probe(name, f"z{t}"))
        conv.append(time.monotonic() - t0)
    before = [n for n in (node_of(m, _BENCH_KEYS) for m in clients[0].members()) if n is not None]
    extra = _start("serf-new", nodes, "", d)
    procs.append(extra)
    xc = extra.wait_ready()
    t0 = time.monotonic()
    xc.join([seed])
    join_s = (
        time.monotonic()
        - t0
        + _wait_all([*clients, xc], lambda c: _status(c, "serf-new") == "alive")
    )
    after = [n for n in (node_of(m, _BENCH_KEYS) for m in clients[0].members()) if n is not None]
    t0 = time.monotonic()
    xc.leave()
    xc.close()
    _wait_all(clients, lambda c: _status(c, "serf-new") in ("left", "failed"))
    leave_s = time.monotonic() - t0
    victim = procs[nodes - 1]
    victim.kill()
    fail_s = _wait_all(clients[:-1], lambda c: _status(c, victim.node) == "failed")
    for c in clients:
        c.close()
    k64 = np.random.default_rng(1).integers(0, 1 << 63, size=keys, dtype=np.int64).astype(np.uint64)
    pb, pa = Placement(before), Placement(after)
    load = np.bincount(pb.primary_index(k64), minlength=len(pb.serving))
    mj = _moved(pb, pa, k64)
    ml = _moved(pb, Placement(before[:-1]), k64)
    return {
        "bench": "cluster", "mode": "real", "nodes": nodes, "trials": trials, "keys": keys,
        "moved_fraction_join": round(mj, 6), "moved_join_over_ideal": round(mj * (nodes + 1), 3),
        "moved_fraction_leave": round(ml, 6), "moved_leave_over_ideal": round(ml * nodes, 3),
        "max_over_mean_load": round(float(load.max() / load.mean()), 4),
        "convergence_s_p50": round(float(np.percentile(conv, 50)), 3),
        "convergence_s_p99": round(float(np.percentile(conv, 99)), 3),
        "join_s": round(join_s, 3), "leave_s": round(leave_s, 3),
        "failure_detect_s": round(fail_s, 2),
        "model_convergence_s_p50": round(float(np.median(_model_s(np.array(
            [gossip_rounds(nodes, np.random.default_rng(s)) for s in range(200)])))), 3),
        "model_failure_detect_s": round(_failure_model_s(nodes), 2),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip


@click.command("cluster")
@click.option(
    "--simulate",
    "mode",
    flag_value="simulate",
    default=True,
    help="Placement code over simulated members plus the gossip model.",
)
@click.option("--real", "mode", flag_value="real", help="Live Serf agents on loopback.")
@click.option("--nodes", type=int, default=1024, show_default=True)
@click.option("--keys", type=int, default=0, help="Chunk keys placed (0: 2,048 per node).")
@click.option(
    "--trials",
    type=int,
    default=200,
    show_default=True,
    help="Gossip model runs (simulate) or tag changes timed (real, at most 20).",
)
@click.option("--replicas", type=int, default=VIEW_REPLICAS, show_default=True,
              help="R for the view-change CPU and (real) the join's moved bytes.")  # fmt: skip
@click.option("--moves/--no-moves", default=True, show_default=True,
              help=f"Real: a join's data move on up to {MOVE_NODES_MAX} agents.")  # fmt: skip
@click.option("--partition/--no-partition", default=True, show_default=True,
              help="Real: a silent-drop partition of one of up to 5 agents in network "
              "namespaces (root): call latency p50/p99/max, misses, heal time.")  # fmt: skip
@click.option("--node-deadline", "node_deadline_s", type=click.FloatRange(0.01, 60),
              default=None, help="Real, partition: the clients' per-node deadline in seconds "
              "(default host_shim's NODE_DEADLINE_S).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cluster_cmd(
    mode: str, nodes: int, keys: int, trials: int, replicas: int, moves: bool,
    partition: bool, node_deadline_s: float | None, as_json: bool,
) -> None:  # fmt: skip
    """Rendezvous placement and Serf membership: moved fraction and bytes, balance,
    convergence, view-change CPU."""
    if not 1 <= replicas <= 8:
        raise click.BadParameter(f"--replicas {replicas}: give 1..8")
    if mode == "real":
        report = run_real(nodes, trials, keys or (1 << 18), replicas=replicas, moves=moves,
                          partition=partition, node_deadline_s=node_deadline_s)  # fmt: skip
    else:
        report = run_simulation(nodes, keys, trials, replicas=replicas)
    if as_json:
        click.echo(json.dumps(report))
    else:
        for k, v in report.items():
            click.echo(f"{k:>28}  {v}")
