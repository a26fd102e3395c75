"""The agent as a service, end to end: a real `dpuctl agent run` child on loopback ports, real
NVMe/TCP, real encryption; KVClient puts and gets byte-exact, survives the agent's death as
misses, and finds its chunks again after a restart or a backup restore."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import RECONNECT_BACKOFF_S, ControlChannel, ControlError
from host_shim.nvme import NvmeError, NvmeTcpController
from kvproto.control import ADMIN_TENANT
from kvproto.keys import ChunkLayout

# 2 layers x K/V x 2 heads x 16 tokens x 64 dims x fp16 = 16 KiB (4 blocks) per chunk
LAYOUT = ChunkLayout("test-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"tenant-salt-0123456789"
ODD = ChunkLayout("odd", "float16", 1, 1, 40, chunk_tokens=30)  # 4800 bytes: a partial block


def chunks_for(seed: int, n: int, layout: ChunkLayout = LAYOUT) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 1 << 16, layout.chunk_shape, dtype=np.uint16).view(np.float16)
        for _ in range(n)
    ]


def tokens_for(seed: int, n: int, layout: ChunkLayout = LAYOUT) -> np.ndarray:
    return np.arange(n * layout.chunk_tokens, dtype=np.uint32) + seed * 100_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var")
    yield a
    a.stop()


def client(a: AgentProcess, timeout_s: float = 5.0) -> KVClient:
    return KVClient(a.control_url, "default", a.token, LAYOUT, SALT, io_queues=2,
                    timeout_s=timeout_s)  # fmt: skip


def test_put_get_byte_exact_numpy_and_bytearray(agent: AgentProcess) -> None:
    data = chunks_for(1, 6)
    tokens = tokens_for(1, 6)
    with client(agent) as c:
        assert c.lookup(tokens) == 0
        assert c.put(tokens, data) == 6
        assert c.lookup(tokens) == 6
        assert c.put(tokens, data) == 6  # already cached: skipped
        out = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(6)]
        assert c.get(tokens, out) == 6
        for a, b in zip(data, out, strict=True):
            assert a.tobytes() == b.tobytes()
        raw = [bytearray(LAYOUT.chunk_bytes) for _ in range(3)]
        assert c.get(tokens, raw) == 3
        assert bytes(raw[2]) == data[2].tobytes()
        # a longer prompt with the same prefix: only the prefix is cached
        longer = np.concatenate([tokens, tokens_for(9, 2)])
        assert c.lookup(longer) == 6
        assert c.get(longer, [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(8)]) == 6


def test_partial_block_chunks_round_trip(agent: AgentProcess) -> None:
    data = chunks_for(2, 3, ODD)
    tokens = tokens_for(2, 3, ODD)
    with KVClient(agent.control_url, "default", agent.token, ODD, SALT) as c:
        assert c.put(tokens, data) == 3
        out = [np.empty(ODD.chunk_shape, np.float16) for _ in range(3)]
        assert c.get(tokens, out) == 3
        assert all(a.tobytes() == b.tobytes() for a, b in zip(data, out, strict=True))


def test_unix_socket_client(agent: AgentProcess) -> None:
    with KVClient(agent.unix_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens_for(3, 2), chunks_for(3, 2)) == 2
        assert c.lookup(tokens_for(3, 2)) == 2


def test_other_tenant_sees_nothing_even_with_same_salt(agent: AgentProcess) -> None:
    with ControlChannel(agent.control_url, ADMIN_TENANT, agent.admin_token) as adm:
        adm.connect()
        token_b = adm.call("tenant_add", tenant="bravo")["token"]
    data, tokens = chunks_for(4, 3), tokens_for(4, 3)
    with client(agent) as a:
        assert a.put(tokens, data) == 3
    with KVClient(agent.control_url, "bravo", token_b, LAYOUT, SALT) as b:
        assert b.lookup(tokens) == 0
        assert b.get(tokens, [np.empty(LAYOUT.chunk_shape, np.float16)] * 3) == 0
        assert b.delete(tokens) == 0
    with client(agent) as a:
        assert a.lookup(tokens) == 3


def test_wrong_token_raises_at_first_call(agent: AgentProcess) -> None:
    with KVClient(agent.control_url, "default", "nope", LAYOUT, SALT) as c:
        with pytest.raises(ControlError) as e:
            c.lookup(tokens_for(5, 1))
        assert e.value.code == "auth"


def test_agent_killed_gives_misses_then_reconnects(tmp_path: Path) -> None:
    env = {"DPUKV_CONTROL_PORT": str(free_port()), "DPUKV_NVMF_PORT": str(free_port())}
    a = spawn_agent(tmp_path / "var", env=env)
    data, tokens = chunks_for(6, 4), tokens_for(6, 4)
    try:
        with client(a, timeout_s=2.0) as c:
            assert c.put(tokens, data) == 4
            a.stop(signal.SIGKILL)
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(4)]
            assert c.lookup(tokens) == 0
            assert c.get(tokens, out) == 0
            assert c.put(tokens, data) == 0
            a = spawn_agent(tmp_path / "var", env=env)  # same ports: the same client reconnects
            time.sleep(RECONNECT_BACKOFF_S)  # calls within the backoff are misses by design
            assert c.put(tokens, data) == 4  # DRAM chunks died with the process; put again
            assert c.get(tokens, out) == 4
            assert out[3].tobytes() == data[3].tobytes()
    finally:
        a.stop()


def test_restart_keeps_committed_chunks(tmp_path: Path) -> None:
    data, tokens = chunks_for(7, 5), tokens_for(7, 5)
    a = spawn_agent(tmp_path / "var")
    try:
        with client(a) as c:
            assert c.put(tokens, data) == 5
    finally:
        assert a.stop(signal.SIGINT) == 0
    a = spawn_agent(tmp_path / "var")
    try:
        with client(a) as c:
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(5)]
            assert c.get(tokens, out) == 5
            assert all(x.tobytes() == y.tobytes() for x, y in zip(data, out, strict=True))
    finally:
        a.stop()


# 16 KiB chunks above 1/8 of a 64 KiB DRAM tier go straight to the persistent tier
SMALL_DRAM = {"DPUKV_STORAGE_DRAM_BYTES": str(64 << 10)}
FIRST, SECOND = (chunks_for(8, 3), tokens_for(8, 3)), (chunks_for(9, 2), tokens_for(9, 2))


def dpuctl(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data_dir), **SMALL_DRAM}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args, "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def backups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full backup after FIRST, an incremental after SECOND, taken with dpuctl."""
    root = tmp_path_factory.mktemp("backups")
    a = spawn_agent(root / "a", env=SMALL_DRAM)
    try:
        with client(a) as c:
            assert c.put(FIRST[1], FIRST[0]) == 3
            r = dpuctl(a.data_dir, "backup", "create", str(root / "full"))
            assert r.returncode == 0, r.stdout + r.stderr
            assert c.put(SECOND[1], SECOND[0]) == 2
            r = dpuctl(a.data_dir, "backup", "create", "--incremental", str(root / "incr"))
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        a.stop()
    return root


def restore_and_check(root: Path, name: str, dirs: list[str], expect: list[tuple]) -> None:
    fresh = root / name
    fresh.mkdir()
    shutil.copy2(root / "a" / "keys.json", fresh / "keys.json")  # same XTS keys
    b = spawn_agent(fresh, env=SMALL_DRAM)
    try:
        r = dpuctl(fresh, "backup", "restore", "--yes", *(str(root / d) for d in dirs))
        assert r.returncode == 0, r.stdout + r.stderr
        with client(b) as c:
            for data, tokens in expect:
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in data]
                assert c.get(tokens, out) == len(data)
                assert all(x.tobytes() == y.tobytes() for x, y in zip(data, out, strict=True))
    finally:
        b.stop()


def test_full_backup_restores_into_fresh_agent(backups: Path) -> None:
    restore_and_check(backups, "b", ["full"], [FIRST])


def test_incremental_backup_restores_chunks_committed_after_the_full_one(backups: Path) -> None:
    restore_and_check(backups, "c", ["full", "incr"], [FIRST, SECOND])


def test_metrics_endpoint_serves_control_and_engine_metrics(agent: AgentProcess) -> None:
    with client(agent) as c:
        c.put(tokens_for(10, 2), chunks_for(10, 2))
        c.lookup(tokens_for(10, 3))
    body = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    for name in (
        "kvtier_control_requests_total",
        "kvtier_control_request_seconds_bucket",
        "kvtier_hit_ratio",
        "kvtier_bytes_in_total",
        "kvtier_engine_lookup_chunks_total",
        "kvtier_engine_tier_used_bytes",
        "process_cpu_seconds_total",
    ):
        assert name in body, name


def test_data_plane_refuses_other_tenants_subsystem(agent: AgentProcess) -> None:
    """B authenticated as B cannot connect its host NQN to A's NVMe-oF subsystem."""
    with ControlChannel(agent.control_url, ADMIN_TENANT, agent.admin_token) as adm:
        adm.connect()
        token_b = adm.call("tenant_add", tenant="charlie")["token"]
    with ControlChannel(agent.control_url, "charlie", token_b) as b:
        nvme = b.connect()["nvme"]
        assert nvme["subnqn"].endswith(":charlie")
        own = NvmeTcpController.connect(nvme["host"], nvme["port"], nvme["subnqn"], b.hostnqn)
        own.close()
        other = nvme["subnqn"].replace(":charlie", ":default")
        with pytest.raises(NvmeError):
            NvmeTcpController.connect(nvme["host"], nvme["port"], other, b.hostnqn)


def test_runtime_tenant_survives_restart(tmp_path: Path) -> None:
    a = spawn_agent(tmp_path / "var")
    try:
        with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token) as adm:
            adm.connect()
            token = adm.call("tenant_add", tenant="delta")["token"]
        with KVClient(a.control_url, "delta", token, LAYOUT, SALT) as c:
            assert c.put(tokens_for(11, 2), chunks_for(11, 2)) == 2
    finally:
        assert a.stop() == 0
    a = spawn_agent(tmp_path / "var")
    try:
        with KVClient(a.control_url, "delta", token, LAYOUT, SALT) as c:
            assert c.lookup(tokens_for(11, 2)) == 2
        with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token) as adm:
            adm.connect()
            adm.call("tenant_remove", tenant="delta")
        with (
            KVClient(a.control_url, "delta", token, LAYOUT, SALT) as c,
            pytest.raises(ControlError),
        ):
            c.lookup(tokens_for(11, 2))
    finally:
        a.stop()


def test_agent_run_prints_what_it_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    a = spawn_agent(tmp_path / "var")
    assert a.stop(signal.SIGTERM) == 0
    out = (tmp_path / "var" / "agent.log").read_text()
    for text in (a.control_url, a.state["nvmf"], "dpuctl status", "KVClient", "stopped"):
        assert text in out, text
    assert not (tmp_path / "var" / "agent.json").exists()  # the state file goes with the agent
    assert not (tmp_path / "var" / "control.sock").exists()


def test_agent_run_with_a_config_file_and_its_tenants(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        "[storage]\ndram_bytes = 1048576\nnvme_bytes = 8388608\n"
        '[tenants.acme]\ntoken = "acme-token-0123456789"\nquota_bytes = 4194304\n'
    )
    a = spawn_agent(tmp_path / "var", config=config)
    try:
        assert a.token == ""  # no default tenant: the file names its own
        with KVClient(a.control_url, "acme", "acme-token-0123456789", LAYOUT, SALT) as c:
            assert c.put(tokens_for(12, 2), chunks_for(12, 2)) == 2
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
            assert c.get(tokens_for(12, 2), out) == 2
            assert c.channel.call("stats")["stats"]["quota_bytes"] == 4 << 20
    finally:
        a.stop()
