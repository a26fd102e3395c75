"""The NVMe tier's file starts the kernel's write-out every `writeback_after_bytes` written, so
the group commit's fsync never finds a second of puts still dirty (issue 10, finding 6: a
300 MiB fsync stalled every thread of the machine for milliseconds). The figure is a benchmark
(`dpuctl bench recovery --sync-mib 300`); these tests check the mechanism and its plumbing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dpu_agent import blockdev
from dpu_agent.blockdev import WRITEBACK_AFTER_BYTES, FileBlockDevice
from dpu_agent.engine import Engine, EngineConfig

MIB = 1 << 20


class _Calls:
    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, []

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.calls.append((offset, nbytes, flags))
        return int(self.real(fd, offset, nbytes, flags))


@pytest.fixture
def sfr_calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    real = blockdev._sync_file_range()
    if real is None:
        pytest.skip("this C library has no sync_file_range (not Linux)")
    calls = _Calls(real)
    monkeypatch.setattr(blockdev, "_SFR", [calls])
    return calls


def test_sync_file_range_binding_works_on_a_real_file(tmp_path: Path) -> None:
    """The cffi declaration matches glibc's: a real call on a real file returns 0."""
    sfr = blockdev._sync_file_range()
    if sfr is None:
        pytest.skip("this C library has no sync_file_range (not Linux)")
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        assert sfr(fd, 0, 0, blockdev._SYNC_FILE_RANGE_WRITE) == 0
        assert sfr(-1, 0, 0, blockdev._SYNC_FILE_RANGE_WRITE) == -1  # errors come back, not raise
    finally:
        os.close(fd)


def test_file_tier_starts_writeback_every_writeback_after_bytes(
    tmp_path: Path, sfr_calls: _Calls
) -> None:
    dev = FileBlockDevice(tmp_path / "nvme.img", block_count=2048, writeback_after_bytes=MIB)
    try:
        for i in range(6):  # 6 half-MiB writes: write-out started after the 2nd, 4th and 6th
            dev.write(i * 128, bytes(MIB // 2))
        assert len(sfr_calls.calls) == 3
        assert all(c == (0, 0, blockdev._SYNC_FILE_RANGE_WRITE) for c in sfr_calls.calls)
        dev.flush()  # durability is still flush()'s: it works after the kicks
    finally:
        dev.close()


def test_writeback_after_zero_leaves_it_all_to_flush(tmp_path: Path, sfr_calls: _Calls) -> None:
    dev = FileBlockDevice(tmp_path / "nvme.img", block_count=2048, writeback_after_bytes=0)
    try:
        for i in range(8):
            dev.write(i * 256, bytes(MIB))
        assert sfr_calls.calls == []
    finally:
        dev.close()


def test_engine_config_reaches_the_nvme_tier_file(tmp_path: Path, sfr_calls: _Calls) -> None:
    """EngineConfig.writeback_after_bytes is what the embedded NVMe tier's file uses; chunks
    written to NVMe (demotion here) start write-out, and the default is one chunk's worth."""
    assert EngineConfig(data_dir=tmp_path).writeback_after_bytes == WRITEBACK_AFTER_BYTES == MIB
    with pytest.raises(ValueError, match="writeback_after_bytes"):
        EngineConfig(data_dir=tmp_path, writeback_after_bytes=-1)
    cfg = EngineConfig(data_dir=tmp_path / "a", dram_bytes=4 * MIB, nvme_bytes=64 * MIB,
                       dram_free_fraction=0.5, tenants={"t": 0})  # fmt: skip
    eng = Engine(cfg)
    try:
        for i in range(4):
            eng.put_chunk("t", bytes([i]) * 16, os.urandom(MIB))
        eng.tick()  # demotes DRAM chunks to the NVMe file
        assert eng.stats()["tenants"]["t"]["tiers"]["nvme"]["records"] >= 1
        assert len(sfr_calls.calls) >= 1
    finally:
        eng.close()
