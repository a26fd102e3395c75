"""The plain block devices: range checks, round trips, the zero-copy view, full files."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.blockdev import BlockDeviceError, FileBlockDevice, MemoryBlockDevice

BS = 4096


def test_memory_view_is_the_device_memory() -> None:
    dev = MemoryBlockDevice(8)
    view = dev.view(2, 2)
    view[:] = b"\x5a" * (2 * BS)
    out = bytearray(2 * BS)
    dev.read_into(2, memoryview(out))
    assert out == b"\x5a" * (2 * BS)
    with pytest.raises(BlockDeviceError, match="outside device"):
        dev.view(7, 2)
    view.release()
    dev.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_round_trip_and_range_errors(kind: str, tmp_path: Path) -> None:
    dev = MemoryBlockDevice(4) if kind == "memory" else FileBlockDevice(tmp_path / "d", 4)
    data = bytes(range(256)) * (BS // 256)
    dev.write(3, data)
    out = bytearray(BS)
    dev.read_into(3, memoryview(out))
    assert out == data
    with pytest.raises(BlockDeviceError, match="outside device"):
        dev.write(4, data)
    with pytest.raises(BlockDeviceError, match="not a multiple"):
        dev.write(0, b"short")
    dev.deallocate(3, 1)
    dev.read_into(3, memoryview(out))
    assert out == bytes(BS)
    dev.close()


def test_file_device_needs_a_size_to_create(tmp_path: Path) -> None:
    with pytest.raises(BlockDeviceError, match="no blocks"):
        FileBlockDevice(tmp_path / "empty")


def test_file_device_reopens_with_its_size(tmp_path: Path) -> None:
    FileBlockDevice(tmp_path / "d", 16).close()
    dev = FileBlockDevice(tmp_path / "d")
    assert dev.block_count == 16
    dev.close()
