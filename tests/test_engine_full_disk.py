"""A full disk under the NVMe tier: a clear error, nothing committed lost, the engine serves on.

The tier file is sparse (sized with ftruncate), so a filesystem that fills up surfaces as
ENOSPC on a write, long after the file was created. A real small tmpfs stands in for the full
disk; mounting one needs root (CI runs as root), otherwise the test skips with that reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.engine import Engine, EngineConfig, EngineError

BS = 4096
FS_BYTES = 256 * 1024  # the disk: room for a few 64 KiB chunks, far less than nvme_bytes


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as a full disk needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def chunk(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 251 + 1]) * (16 * BS)  # 64 KiB


def test_full_disk_is_a_clear_error_and_loses_nothing(tmp_path: Path, small_fs: Path) -> None:
    cfg = EngineConfig(
        data_dir=tmp_path / "data",
        nvme_dir=small_fs,
        dram_bytes=16 * BS,  # one chunk: the rest must go to the NVMe tier
        nvme_bytes=1024 * BS,  # 4 MiB promised by a 256 KiB disk
        tenants={"acme": 0},
    )
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
        for key, data in stored.items():  # what was committed before the disk filled
            got = eng.get_chunk("acme", key)
            assert got is None or got == data  # a miss is allowed (evicted), wrong bytes never
        assert sum(eng.get_chunk("acme", k) is not None for k in stored) >= 1
        eng.tick()  # background demotion into the full disk must not break the engine
        assert eng.lookup("acme", [chunk(999)[0]]).hits == []  # still serving
    finally:
        eng.close()
    again = Engine(cfg)  # restart: nothing corrupt is served
    try:
        for key, data in stored.items():
            got = again.get_chunk("acme", key)
            assert got is None or got == data
        assert again.stats()["integrity_failures"] == 0
    finally:
        again.close()
