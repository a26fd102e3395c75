"""A full disk: a clear error, nothing acknowledged lost, the engine serves on (issue 10, 1/5/7).

The tier file is sparse (sized with ftruncate), so a filesystem that fills up surfaces as
ENOSPC on a write, long after the file was created. A real small tmpfs stands in for the full
disk, holding the journal and the data as `./var` does by default; mounting one needs root (CI
runs as root), otherwise the tests skip with that reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.engine import Engine, EngineConfig, EngineError
from dpu_agent.engine.errors import JournalUnavailable

BS = 4096
FS_BYTES = 256 * 1024  # the disk: room for a few 64 KiB chunks, far less than nvme_bytes
PUTS_MAX = 2000  # bounds every fill loop


def mount_tmpfs(mnt: Path, size: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as a full disk needs root")
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mount_tmpfs(mnt, FS_BYTES)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mount_tmpfs(mnt, 64 * 1024)  # the 64 KiB of the finding
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def chunk(i: int, blocks: int = 16) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 251 + 1]) * (blocks * BS)


def full_disk_config(tmp_path: Path, fs: Path) -> EngineConfig:
    return EngineConfig(
        data_dir=fs,  # journal, NVMe file and keys on the one small disk, as ./var by default
        key_file=tmp_path / "keys.json",
        dram_bytes=4 * BS,  # no chunk fits DRAM: every acknowledged chunk is on the NVMe tier
        nvme_bytes=1024 * BS,  # 4 MiB promised by a 256 KiB disk
        tenants={"acme": 0},
    )


def test_full_disk_is_a_clear_error_and_loses_nothing(tmp_path: Path, small_fs: Path) -> None:
    cfg = full_disk_config(tmp_path, small_fs)
    eng = Engine(cfg)
    stored: dict[bytes, bytes] = {}
    failure: Exception | None = None
    try:
        for i in range(40):  # bounded: 2.5 MiB of writes against a 256 KiB disk
            key, data = chunk(i)
            try:
                eng.put_chunk("acme", key, data)
            except (EngineError, BlockDeviceError) as e:
                failure = e
                break
            stored[key] = data
        assert failure is not None, "a 256 KiB disk took 2.5 MiB"
        assert "No space left" in str(failure) or "full" in str(failure), failure
        assert stored
        for key, data in stored.items():  # every acknowledged chunk, byte-exact
            assert eng.get_chunk("acme", key) == data
        eng.tick()
        assert eng.lookup("acme", [chunk(999)[0]]).hits == []  # still serving
    finally:
        eng.close()  # on a full disk: must not raise
    assert not list(small_fs.rglob("*.tmp"))
    again = Engine(cfg)  # restart: every acknowledged chunk is back
    try:
        for key, data in stored.items():
            assert again.get_chunk("acme", key) == data
        assert again.stats()["integrity_failures"] == 0
    finally:
        again.close()


def test_failed_wal_append_fences_writes_and_loses_no_later_commit(
    tmp_path: Path, tiny_fs: Path
) -> None:
    """Finding 1: ENOSPC in the WAL was an AssertionError, the failed chunk was still served,
    and commits acknowledged after space came back were lost at the next kill -9."""
    cfg = EngineConfig(
        data_dir=tmp_path / "data",
        journal_dir=tiny_fs,
        dram_bytes=4 * BS,
        nvme_bytes=4096 * BS,
        tenants={"acme": 0},
    )
    filler = tiny_fs / "filler"
    with open(filler, "wb") as f:  # leave the journal ~8 KiB: ~90 frames
        f.write(bytes(48 * 1024))
    eng = Engine(cfg)
    acked: dict[bytes, bytes] = {}
    refused: JournalUnavailable | None = None
    for i in range(PUTS_MAX):
        key, data = chunk(i, blocks=1)
        try:
            eng.put_chunk("acme", key, data)
        except JournalUnavailable as e:
            refused = e
            failed_key = key
            break
        acked[key] = data
    assert refused is not None and refused.full, refused
    assert eng.lookup("acme", [failed_key]).hits == []  # not journaled: never served
    assert eng.stats()["journal_fenced"]
    with pytest.raises(JournalUnavailable, match="full"):  # fenced until writable again
        eng.put_chunk("acme", *chunk(PUTS_MAX + 1, blocks=1))
    filler.unlink()  # space comes back
    eng.tick()  # the probe lifts the fence
    assert eng.stats()["journal_fenced"] == ""
    for i in range(PUTS_MAX + 10, PUTS_MAX + 20):
        key, data = chunk(i, blocks=1)
        eng.put_chunk("acme", key, data)
        acked[key] = data
    eng._commit.journal.close()  # kill -9: no checkpoint, the WAL as written
    again = Engine(cfg)
    try:
        for key, data in acked.items():
            assert again.get_chunk("acme", key) == data, key.hex()
        assert again.recovery_report.damaged_frames == 0
    finally:
        again.close()


def test_full_journal_disk_is_refused_over_the_control_plane_and_doctor_says_why(
    tmp_path: Path, tiny_fs: Path
) -> None:
    """The agent fences writes with a clear `full` reply while its journal's disk is full,
    `dpuctl doctor` says why, and writes come back once there is room."""
    import json
    import sys
    import time

    from dpu_agent.testing import spawn_agent
    from host_shim.client import ControlChannel, ControlError

    env = {"DPUKV_STORAGE_JOURNAL_DIR": str(tiny_fs), "DPUKV_STORAGE_DRAM_BYTES": str(16 << 10)}
    a = spawn_agent(tmp_path / "var", env=env)
    filler = tiny_fs / "filler"
    try:
        st = os.statvfs(tiny_fs)
        with open(filler, "wb") as f:  # all but two pages of what the agent left free
            f.write(bytes(st.f_bavail * st.f_frsize - 8 * 1024))
        refused: ControlError | None = None
        with ControlChannel(a.control_url, "default", a.token) as ch:
            ch.connect()
            for i in range(PUTS_MAX):
                try:
                    r = ch.call("reserve", key=i.to_bytes(16, "big"), length=BS)
                    ch.call("commit", reservation_id=r["reservation_id"], checksum=bytes(16))
                except ControlError as e:
                    refused = e
                    break
            assert refused is not None and refused.code == "full", refused
            assert "journal" in refused.message and "retries" in refused.message
            doctor = subprocess.run(
                [sys.executable, "-c", "from dpu_agent.cli import main; main()", "doctor",
                 "--json"],
                env={**os.environ, "DPUKV_AGENT_DATA_DIR": str(a.data_dir), **env},
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            rows = {r["check"]: r for r in json.loads(doctor.stdout)}
            assert rows["agent-storage"]["status"] == "missing", rows["agent-storage"]
            assert "journal refuses writes" in rows["agent-storage"]["detail"]
            filler.unlink()
            deadline = time.monotonic() + 10
            while True:  # the tick's probe lifts the fence within a tick interval
                try:
                    ch.call("reserve", key=b"z" * 16, length=BS)
                    break
                except ControlError:
                    assert time.monotonic() < deadline, "writes never came back"
                    time.sleep(0.2)
    finally:
        a.stop()
