"""Real agents in cluster mode on loopback: each a `dpuctl agent run` child with its own Serf
child, all sharing one tenant token file (tenants are cluster-wide through shared config), one
gossip keyring (each node gets its own copy: Serf rewrites it on key changes) and one cluster
peer key."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dpu_agent.cluster import free_port
from dpu_agent.cluster._serf_process import PICK_PORT_RANGE
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.client import ControlChannel, ControlError


def write_secret(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def gossip_key() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


def write_cluster_secrets(root: Path) -> tuple[bytes, ...]:
    """root/keyring.json (one gossip key) and root/peer.key (one cluster key), both 0600;
    returns the peer keys."""
    write_secret(root / "keyring.json", json.dumps([gossip_key()]))
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    write_secret(root / "peer.key", key + "\n")
    return (key.encode(),)


def secrets_env(root: Path, node_dir: Path) -> dict[str, str]:
    """The env that gives a node the cluster's secrets; its own copy of the keyring."""
    node_dir.mkdir(parents=True, exist_ok=True)
    if not (node_dir / "serf-keyring.json").exists():
        shutil.copy(root / "keyring.json", node_dir / "serf-keyring.json")
        os.chmod(node_dir / "serf-keyring.json", 0o600)
    return {
        "DPUKV_CLUSTER_KEYRING_FILE": str(node_dir / "serf-keyring.json"),
        "DPUKV_CLUSTER_PEER_KEY_FILE": str(root / "peer.key"),
    }


def _port(host: str, netns: str | None) -> int:
    """A free port on `host`; in a namespace a test made (nothing else binds there), any
    port from the range Serf ports are picked from."""
    if netns is None:
        return free_port(host)
    return random.randrange(*PICK_PORT_RANGE)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def veth_netns(prefix: str, octet: int) -> Iterator[tuple[str, str, str, str]]:
    """A namespace joined to this one by a veth pair on 10.`octet`.X.0/24, named
    `prefix`p/a/b + a random tag: (namespace, ns-side veth, host address, namespace address);
    deleted afterwards. Skips (naming what is missing) where namespaces cannot be made."""
    if shutil.which("serf") is None or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs serf, root and iproute2 to make a network namespace")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"{prefix}p{tag}", f"{prefix}a{tag}", f"{prefix}b{tag}"
    net = f"10.{octet}.{int(tag[:2], 16)}"
    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr!r}")
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{net}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", ns_if)
        ip("-n", ns, "link", "set", ns_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, ns_if, f"{net}.1", f"{net}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


SMALL_TIERS = {"DPUKV_STORAGE_DRAM_BYTES": str(16 << 20), "DPUKV_STORAGE_NVME_BYTES": str(64 << 20)}


@dataclass
class Node:
    name: str
    agent: AgentProcess
    serf_bind: str
    serf_rpc: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Cluster:
    root: Path
    replicas: int = 1
    host: str = "127.0.0.1"  # where the Serf agents bind
    nodes: dict[str, Node] = field(default_factory=dict)
    token: str = ""
    peer_keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.peer_keys = write_cluster_secrets(self.root)
        self.token = secrets.token_urlsafe(24)
        fd = os.open(self.root / "default.token", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        (self.root / "cluster.toml").write_text(
            f'[tenants.default]\ntoken_file = "{self.root / "default.token"}"\n'
        )

    def start(
        self,
        name: str,
        zone: str = "",
        serf_rpc: str = "",
        extra_env: dict[str, str] | None = None,
        *,
        netns: str | None = None,
        host: str = "",
    ) -> Node:
        """Start agent `name`; with `serf_rpc` it uses that (operator-run) Serf agent. With
        `netns` and `host` the agent and its Serf run in that namespace on that address."""
        seeds = [n.serf_bind for n in self.nodes.values() if n.agent.proc.poll() is None]
        host = host or self.host
        bind = f"{host}:{_port(host, netns)}"
        rpc = serf_rpc or f"{host}:{_port(host, netns)}"
        env = {
            "DPUKV_CLUSTER_SERF_START": "0" if serf_rpc else "1",
            **SMALL_TIERS,
            "DPUKV_AGENT_NODE_NAME": name,
            "DPUKV_CLUSTER_ENABLED": "1",
            "DPUKV_CLUSTER_SERF_BIND": bind,
            "DPUKV_CLUSTER_SERF_RPC": rpc,
            "DPUKV_CLUSTER_JOIN": ",".join(seeds[:2]),
            "DPUKV_CLUSTER_REPLICAS": str(self.replicas),
            "DPUKV_CLUSTER_REFRESH_INTERVAL_S": "1",
            "DPUKV_CLUSTER_ZONE": zone,
            "DPUKV_METRICS_ENABLED": "0",
            **secrets_env(self.root, self.root / name),
            **(extra_env or {}),
        }
        agent = spawn_agent(self.root / name, env=env, config=self.root / "cluster.toml",
                            netns=netns)  # fmt: skip
        env["DPUKV_AGENT_DATA_DIR"] = str(self.root / name)
        node = self.nodes[name] = Node(name, agent, bind, rpc, env)
        return node

    def dpuctl(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`dpuctl ARGS --config cluster.toml` as node `name`'s operator."""
        env = {**os.environ, **self.nodes[name].env}
        return subprocess.run(
            [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args,
             "--config", str(self.root / "cluster.toml")],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    def seeds(self) -> str:
        return ",".join(n.agent.control_url for n in self.nodes.values())

    def members(self, name: str) -> dict:
        a = self.nodes[name].agent
        with ControlChannel(a.control_url, "default", self.token, timeout_s=5.0) as ch:
            ch.connect()
            return ch.call("members")

    def wait_serving(self, names: list[str], on: list[str], timeout_s: float = 40.0) -> int:
        """Wait until every node in `on` sees exactly `names` serving; returns the epoch."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                views = [self.members(n) for n in on]
            except (ControlError, OSError) as e:
                last = e
                time.sleep(0.2)
                continue
            serving = [
                sorted(m["name"] for m in v["members"]
                       if m["status"] == "alive" and m["state"] == "serving")
                for v in views
            ]  # fmt: skip
            epochs = {v["epoch"] for v in views}
            if all(s == sorted(names) for s in serving) and len(epochs) == 1:
                return int(epochs.pop())
            last = serving
            time.sleep(0.2)
        raise AssertionError(f"cluster did not converge on {names}: {last}")

    def stop_all(self) -> None:
        for n in self.nodes.values():
            if n.agent.proc.poll() is None:
                n.agent.stop(timeout_s=20)
