"""A kill -9 during `backup restore` used to leave a partial restore (785 of 1,200 chunks) that
nothing reported: the agent served a cache that silently lacked a third of the backup, and a
new restore was refused because the agent held chunks. Now the restore writes a marker before
it changes anything and removes it after its checkpoint; a restart with the marker says so in
`dpuctl status` and `dpuctl doctor`, and `dpuctl backup restore --rollback` (drop what it
placed) or `--resume` (start it over) finishes it.

Real agents, a real SIGKILL while the restore's commits reach the WAL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.engine.journal import FRAME_BYTES
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import ControlChannel
from kvproto.control import ADMIN_TENANT

PUTS = 150  # puts of 8 chunks: the finding's 1,200 chunks (16 KiB each)
PER_PUT = 8
CHUNKS = PUTS * PER_PUT
KILL_AT_FRAMES = 200  # SIGKILL once this many of the restore's commits are in the WAL
KILL_WAIT_S = 120.0  # the restore must reach that point within this (a loaded 2-core box)
ENV = {"DPUKV_STORAGE_DRAM_BYTES": str(16 << 10)}  # every chunk on NVMe (what backups hold)


def dpuctl(a: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(a.data_dir), **ENV}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def records(a: AgentProcess) -> int:
    with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token, timeout_s=30) as ch:
        ch.connect()
        return int(ch.call("stats")["stats"]["records"])


def wal_frames(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / "journal").glob("wal-*.log")) // FRAME_BYTES


def restore_then_kill(data: Path, backup: Path) -> AgentProcess:
    """Start a restore of `backup` into the agent on `data`, SIGKILL it part-way, restart."""
    a = spawn_agent(data, env=ENV)
    before = wal_frames(data)

    def run() -> None:
        with contextlib.suppress(Exception):  # the agent dies under it
            with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token, timeout_s=300) as ch:
                ch.connect()
                ch.call("restore", dirs=[str(backup)])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + KILL_WAIT_S
    while wal_frames(data) - before < KILL_AT_FRAMES:
        assert t.is_alive(), "the restore finished (or failed) before it could be killed"
        assert time.monotonic() < deadline, "the restore never reached the WAL"
        time.sleep(0.002)
    a.kill()
    t.join(60)
    return spawn_agent(data, env=ENV)


def test_killed_restore_is_reported_and_can_be_rolled_back_or_resumed(tmp_path: Path) -> None:
    src = spawn_agent(tmp_path / "src", env=ENV)
    backup = tmp_path / "backup"
    try:
        with KVClient(src.control_url, "default", src.token, LAYOUT, SALT, timeout_s=30) as c:
            for s in range(PUTS):
                assert c.put(tokens_for(s, PER_PUT), chunks_for(s, PER_PUT)) == PER_PUT
        done = dpuctl(src, "backup", "create", str(backup), "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["backup"]["records"] == CHUNKS
    finally:
        src.stop()
    data = tmp_path / "dst"
    data.mkdir()
    shutil.copy2(tmp_path / "src" / "keys.json", data / "keys.json")  # the same keys

    a = restore_then_kill(data, backup)
    try:
        partial = records(a)
        assert 0 < partial < CHUNKS  # the partial restore of the finding
        member = json.loads(dpuctl(a, "status", "--json").stdout)["members"][0]
        assert member["restore"].startswith("interrupted"), member  # nothing said so before
        assert str(backup) in member["restore"] and "--resume" in member["restore"]
        rows = {r["check"]: r for r in json.loads(dpuctl(a, "doctor", "--json").stdout)}
        assert rows["agent-storage"]["status"] == "missing", rows["agent-storage"]
        assert "interrupted" in rows["agent-storage"]["detail"]
        refused = dpuctl(a, "backup", "restore", str(backup), "--yes", "--json")
        assert refused.returncode != 0 and "--resume" in refused.stderr + refused.stdout
        rolled = dpuctl(a, "backup", "restore", "--rollback", "--yes", "--json")
        assert rolled.returncode == 0, rolled.stderr
        assert json.loads(rolled.stdout)["restore"]["records_dropped"] == partial
        assert records(a) == 0
        member = json.loads(dpuctl(a, "status", "--json").stdout)["members"][0]
        assert member["restore"] == ""
    finally:
        a.stop()

    a = restore_then_kill(data, backup)  # again, and this time resume it
    try:
        assert 0 < records(a) < CHUNKS
        resumed = dpuctl(a, "backup", "restore", "--resume", "--yes", "--json")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["restore"]["records"] == CHUNKS
        assert json.loads(dpuctl(a, "status", "--json").stdout)["members"][0]["restore"] == ""
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=30) as c:
            lost = []
            for s in range(PUTS):
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(PER_PUT)]
                got = c.get(tokens_for(s, PER_PUT), out)
                want = chunks_for(s, PER_PUT)
                same = all(o.tobytes() == w.tobytes() for o, w in zip(out, want, strict=True))
                if got != PER_PUT or not same:
                    lost.append(s)
        # bytes lost after the resume: none of the 1,200 backed-up chunks (16 KiB each)
        assert lost == [], f"{len(lost)} of {PUTS} puts not restored byte-exact"
    finally:
        a.stop()


def test_resume_and_rollback_refuse_clearly_and_drop_nothing_on_bad_input(tmp_path: Path) -> None:
    """Engine level: no marker, a marker whose backups are gone, a marker and a new restore."""
    import pytest

    from dpu_agent.engine import Engine, EngineConfig, EngineError

    bs = 4096
    cfg = EngineConfig(data_dir=tmp_path / "e", dram_bytes=16 * bs, nvme_bytes=256 * bs,
                       tenants={"acme": 0})  # fmt: skip
    eng = Engine(cfg)
    try:
        for mode in ("resume", "rollback"):
            with pytest.raises(EngineError, match="no interrupted restore"):
                eng.restore([], mode)
        eng.put_chunk("acme", b"k" * 16, b"v" * (3 * bs))
        marker = {"dirs": [str(tmp_path / "gone")], "backup_ids": ["x"], "started_unix": 0}
        (cfg.data_dir / "restore.json").write_text(json.dumps(marker))
        with pytest.raises(EngineError, match="gone"):
            eng.restore([], "resume")  # the backups are gone: nothing is dropped
        assert eng.get_chunk("acme", b"k" * 16) == b"v" * (3 * bs)
        with pytest.raises(EngineError, match="--resume"):
            eng.restore([tmp_path / "other"])
        assert eng.restore([], "rollback")["records_dropped"] == 1
        assert eng.stats()["restore_interrupted"] is None
    finally:
        eng.close()
