"""An agent restarted on a full disk used to refuse to start (`cannot start the agent: [Errno
28]`, writing agent.json), so every chunk was unreachable until space was freed. Now it starts,
serves every acknowledged chunk byte-exact, refuses writes with a clear `full` reply, and
`dpuctl status` and `dpuctl doctor` say so; `dpuctl` finds it over its Unix socket when
agent.json could not be written.

The disk is a small tmpfs the test mounts (root needed; otherwise the test skips naming why),
holding the whole data directory. The agent's stdout/stderr go to a file outside it (as under
systemd, where they go to the journal).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_engine_full_disk import mount_tmpfs
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.blockdev import BlockDeviceError, FileBlockDevice
from dpu_agent.testing import spawn_agent
from host_shim import KVClient
from host_shim.client import ControlChannel, ControlError
from kvproto.control import ADMIN_TENANT

FS_BYTES = 16 << 20  # the disk: 16 MiB
PUTS = 50  # puts of 2 chunks (16 KiB each) acknowledged before the kill
START_S_MAX = 60.0  # a start on a loaded 2-core box
ENV = {"DPUKV_STORAGE_DRAM_BYTES": str(16 << 10), "DPUKV_STORAGE_NVME_BYTES": str(64 << 20)}


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mount_tmpfs(mnt, FS_BYTES)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> int:
    """Write zeros until the filesystem refuses; returns the bytes written."""
    total = 0
    with open(path / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                total += f.write(bytes(64 << 10))
        with contextlib.suppress(OSError):
            while True:  # the last partial page
                total += f.write(bytes(512))
    return total


def start_without_state_file(data: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data), "DPUKV_CONTROL_PORT": "0",
           "DPUKV_NVMF_PORT": "0", "DPUKV_METRICS_PORT": "0", **ENV}  # fmt: skip
    args = [sys.executable, "-c", "from dpu_agent.cli import main; main()", "agent", "run"]
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for_socket(proc: subprocess.Popen[bytes], data: Path, log: Path) -> str:
    """The agent's Unix socket URL once it answers an admin hello (it has no agent.json)."""
    sock = f"unix://{data / 'control.sock'}"
    admin = (data / "admin.token").read_text().strip()
    deadline = time.monotonic() + START_S_MAX
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(OSError, ControlError, ConnectionError):
            with ControlChannel(sock, ADMIN_TENANT, admin, timeout_s=5) as ch:
                ch.connect()
                return sock
        assert time.monotonic() < deadline, "the agent did not start on the full disk"
        time.sleep(0.2)


def dpuctl(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data), **ENV}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("state_file", ["left by the killed agent", "removed"])
def test_restart_on_a_full_disk_serves_every_acknowledged_chunk(
    tmp_path: Path, disk: Path, state_file: str
) -> None:
    data = disk / "var"
    a = spawn_agent(data, env=ENV)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            for s in range(PUTS):
                assert c.put(tokens_for(s, 2), chunks_for(s, 2)) == 2
    finally:
        a.kill()  # kill -9: agent.json stays behind, naming a dead pid
    if state_file == "removed":  # no file to rewrite in place: dpuctl finds the socket
        (data / "agent.json").unlink()
    assert fill(disk) > 0
    log = tmp_path / "agent.log"
    proc = start_without_state_file(data, log)
    try:
        sock = wait_for_socket(proc, data, log)  # the old agent exited with [Errno 28]
        token = (data / "tenant-default.token").read_text().strip()
        t0 = time.monotonic()
        with KVClient(sock, "default", token, LAYOUT, SALT, timeout_s=10) as c:
            lost = []
            for s in range(PUTS):
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
                got = c.get(tokens_for(s, 2), out)
                want = chunks_for(s, 2)
                same = all(o.tobytes() == w.tobytes() for o, w in zip(out, want, strict=True))
                if got != 2 or not same:
                    lost.append(s)
            # bytes lost: 0 of the 100 acknowledged chunks (16 KiB each)
            assert lost == [], f"{len(lost)} of {PUTS} acknowledged puts unreadable"
            read_s = time.monotonic() - t0
            assert read_s < 30, read_s  # 100 chunks: milliseconds unloaded
            with pytest.raises(ControlError) as refused:  # writes: fenced, a clear reply
                for s in range(PUTS, PUTS + 20):
                    c.channel.call("reserve", key=s.to_bytes(16, "big"), length=4096)
                    c.put(tokens_for(s, 2), chunks_for(s, 2))
            assert refused.value.code == "full", refused.value
        if state_file == "removed":
            assert not (data / "agent.json").exists()
        else:  # rewritten in place, in the blocks the killed agent's file had
            assert json.loads((data / "agent.json").read_text())["pid"] == proc.pid
        status = dpuctl(data, "status", "--json")
        assert status.returncode == 0, status.stderr
        member = json.loads(status.stdout)["members"][0]
        assert "full" in member["journal"], member
        doctor = dpuctl(data, "doctor", "--json")
        rows = {r["check"]: r for r in json.loads(doctor.stdout)}
        assert rows["agent-storage"]["status"] == "missing", rows["agent-storage"]
        assert "full" in rows["agent-storage"]["detail"], rows["agent-storage"]
    finally:
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_no_inode_for_a_new_wal_segment_still_starts_and_writes_resume_with_room(
    tmp_path: Path,
) -> None:
    """No space and no free inode: the restart cannot even create its new WAL segment. It
    starts (writes fenced `full`, reads served); once there is room the tick's probe opens the
    segment, writes its tenant frames and lifts the fence, and what is acknowledged then
    survives a kill -9."""
    import uuid

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as a full disk needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},nr_inodes=256", "tmpfs",
                        str(mnt)], capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        data = mnt / "var"
        a = spawn_agent(data, env=ENV)
        try:
            with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
                for s in range(10):
                    assert c.put(tokens_for(s, 2), chunks_for(s, 2)) == 2
        finally:
            a.kill()
        fill(mnt)
        empties = mnt / "empties"
        with contextlib.suppress(OSError):
            empties.mkdir()
            for _ in range(1024):  # every inode left (256 in all)
                (empties / uuid.uuid4().hex[:8]).touch()
        log = tmp_path / "agent.log"
        proc = start_without_state_file(data, log)
        try:
            sock = wait_for_socket(proc, data, log)
            token = (data / "tenant-default.token").read_text().strip()
            with KVClient(sock, "default", token, LAYOUT, SALT, timeout_s=10) as c:
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
                assert c.get(tokens_for(3, 2), out) == 2
                assert out[1].tobytes() == chunks_for(3, 2)[1].tobytes()
                with pytest.raises(ControlError) as refused:
                    c.channel.call("reserve", key=bytes(16), length=4096)
                assert refused.value.code == "full", refused.value
                shutil.rmtree(empties)
                (mnt / "filler").unlink()
                deadline = time.monotonic() + 30
                while c.put(tokens_for(99, 2), chunks_for(99, 2)) != 2:  # the probe: 0.5 s
                    assert time.monotonic() < deadline, "writes never came back"
                    time.sleep(0.2)
        finally:
            proc.kill()
            proc.wait(60)
        a = spawn_agent(data, env=ENV)
        try:
            with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
                for s in (3, 99):  # from before the full disk, and acknowledged after it
                    out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
                    assert c.get(tokens_for(s, 2), out) == 2, s
                    want = chunks_for(s, 2)
                    assert all(o.tobytes() == w.tobytes() for o, w in zip(out, want, strict=True))
        finally:
            a.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_file_system_under_the_tier_file_is_named_not_silent(
    tmp_path: Path, disk: Path
) -> None:
    """The tier file is sparse and larger than the file system under it: once that is full
    every put failed while the agent logged nothing, `dpuctl doctor` said ok and no stat
    moved (the journal, on another disk, stayed writable). Now the log, `stats` and `doctor`
    name it, and reads are served."""
    data = tmp_path / "var"
    env = {**ENV, "DPUKV_STORAGE_NVME_DIR": str(disk / "nvme")}  # 64 MiB file on a 16 MiB disk
    a = spawn_agent(data, env=env)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            for s in range(FS_BYTES >> 14):  # bounded: the disk holds fewer 16 KiB chunks
                if c.put(tokens_for(s, 2), chunks_for(s, 2)) < 2:
                    break
            else:
                pytest.fail("the tier's file system never filled")
            stats = a.admin("stats")["stats"]
            tier = stats["tenants"]["default"]["tiers"]["nvme"]
            assert stats["tiers_full"] == 1 and tier["full"] and tier["full_writes"] >= 1, stats
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
            assert c.get(tokens_for(0, 2), out) == 2  # reads served
            assert out[0].tobytes() == chunks_for(0, 2)[0].tobytes()
        doctor = dpuctl(data, "doctor", "--json")
        rows = {r["check"]: r for r in json.loads(doctor.stdout)}
        assert rows["agent-storage"]["status"] == "missing", rows["agent-storage"]
        assert "want of space" in rows["agent-storage"]["detail"], rows["agent-storage"]
        text = (data / "agent.log").read_text()
        assert "nvmf_io_device_error" in text and "(full)" in text
        # said at the start, before any put failed: 64 MiB of tier on a 16 MiB disk
        assert "storage_overcommitted" in text.split("nvmf_io_device_error")[0]
    finally:
        a.stop()


def test_a_tier_file_is_full_until_a_write_lands(disk: Path) -> None:
    """FileBlockDevice.full: set when the file system refuses a write for space, cleared by
    the next write that lands (here over blocks the file already has)."""
    dev = FileBlockDevice(disk / "nvme.img", block_count=(FS_BYTES >> 12) * 2)
    try:
        block = bytes(range(256)) * 16
        lba = 0
        with pytest.raises(BlockDeviceError, match=r"\(full\)"):
            while lba < dev.block_count:  # bounded: the file is twice the disk
                dev.write(lba, block)
                lba += 1
        assert dev.full and dev.full_writes == 1
        dev.write(0, block)  # allocated already: lands
        assert not dev.full and dev.full_writes == 1
    finally:
        dev.close()
