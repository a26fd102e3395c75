"""Backups used to skip DRAM-only chunks silently (a first backup after the README example held 0
records); `restore` into a running agent that held chunks returned 0; a restore did not recreate
the backup's tenants. Real agents, real dpuctl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("bk", "float16", num_layers=1, num_kv_heads=2, head_dim=64, chunk_tokens=16)
SALT = b"backup-test-salt"


def dpuctl(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data_dir)}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args, "--json"],
        env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip


def chunks(seed: int, n: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    data = [rng.standard_normal(LAYOUT.chunk_shape).astype(np.float16) for _ in range(n)]
    return data, [seed * 1000 + i for i in range(n * LAYOUT.chunk_tokens)]


def client(a: AgentProcess, tenant: str = "default", token: str = "") -> KVClient:
    return KVClient(a.control_url, tenant, token or a.token, LAYOUT, salt=SALT)


def read_back(a: AgentProcess, data: list[np.ndarray], tokens: list[int], **kw: str) -> None:
    out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in data]
    with client(a, **kw) as c:
        assert c.get(tokens, out) == len(data)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(data, out, strict=True))


def test_backup_of_dram_only_chunks_holds_them_and_restore_rules(tmp_path: Path) -> None:
    data, tokens = chunks(1, 4)  # 16 KiB chunks: they stay in the 256 MiB DRAM tier
    other, other_tokens = chunks(2, 3)
    a = spawn_agent(tmp_path / "a")
    try:
        added = json.loads(dpuctl(a.data_dir, "tenants", "add", "acme").stdout)
        with client(a) as c:
            assert c.put(tokens, data) == 4
        with client(a, tenant="acme", token=added["token"]) as c:
            assert c.put(other_tokens, other) == 3
        r = dpuctl(a.data_dir, "backup", "create", str(tmp_path / "full"))
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(r.stdout)["backup"]
        assert result["records"] == 7 and result["dram_only_chunks"] == 0, result
        assert result["dram_persisted"] == 7
        read_back(a, data, tokens)  # still served after being moved to NVMe
        # into an agent that holds chunks: refused, nothing changes
        r = dpuctl(a.data_dir, "backup", "restore", "--yes", str(tmp_path / "full"))
        assert r.returncode == 1 and "holds no chunks" in json.loads(r.stdout)["error"]
        read_back(a, data, tokens)
    finally:
        a.stop()
    fresh = tmp_path / "b"
    fresh.mkdir()
    shutil.copy2(tmp_path / "a" / "keys.json", fresh / "keys.json")  # the same XTS keys
    b = spawn_agent(fresh)
    try:
        r = dpuctl(b.data_dir, "backup", "restore", "--yes", str(tmp_path / "full"))
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["restore"]["records"] == 7 and list(doc["tenants_added"]) == ["acme"]
        read_back(b, data, tokens)
        token = Path(doc["tenants_added"]["acme"]).read_text().strip()  # a new token
        assert token != added["token"]
        read_back(b, other, other_tokens, tenant="acme", token=token)
    finally:
        b.stop()


def test_restore_keeps_the_quota_of_a_tenant_it_re_adds_and_names_its_token_file(
    tmp_path: Path,
) -> None:
    data, tokens = chunks(3, 2)
    a = spawn_agent(tmp_path / "a")
    try:
        added = json.loads(dpuctl(a.data_dir, "tenants", "add", "acme", "--quota", "1GiB").stdout)
        with client(a, tenant="acme", token=added["token"]) as c:
            assert c.put(tokens, data) == 2
        assert dpuctl(a.data_dir, "backup", "create", str(tmp_path / "full")).returncode == 0
    finally:
        a.stop()
    fresh = tmp_path / "b"
    fresh.mkdir()
    shutil.copy2(tmp_path / "a" / "keys.json", fresh / "keys.json")
    b = spawn_agent(fresh)
    try:
        env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(b.data_dir)}
        human = subprocess.run(
            [sys.executable, "-c", "from dpu_agent.cli import main; main()",
             "backup", "restore", "--yes", str(tmp_path / "full")],
            env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
        )  # fmt: skip
        assert human.returncode == 0, human.stdout + human.stderr
        token_file = str(b.data_dir / "tenant-acme.token")
        assert "tenants_added" in human.stdout and "acme" in human.stdout
        assert token_file in human.stdout, human.stdout  # piped: 200 columns, not folded
        rows = json.loads(dpuctl(b.data_dir, "tenants", "list").stdout)["tenants"]
        assert {r["name"]: r["quota_bytes"] for r in rows}["acme"] == 1 << 30, rows
    finally:
        b.stop()
