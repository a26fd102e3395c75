"""The plain block devices: range checks, round trips, the zero-copy view, full files."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_closed_file_device_refuses_io_and_has_nothing_to_flush(tmp_path: Path) -> None:
    """A tenant removed while the tick fsyncs every device closed one under the flush, which
    raised ValueError on descriptor -1 and stopped the agent (found by an attack pass)."""
    dev = FileBlockDevice(tmp_path / "f.img", block_count=4)
    dev.close()
    dev.flush()  # nothing left to make durable: not an error that fences every tenant
    with pytest.raises(BlockDeviceError, match="closed"):
        dev.write(0, bytes(4096))
    with pytest.raises(BlockDeviceError, match="closed"):
        dev.read_into(0, memoryview(bytearray(4096)))
    dev.close()  # twice: nothing


def test_close_waits_for_the_descriptor_a_call_is_using(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write in flight when the device closes keeps its descriptor until it returns: closed
    under it, the number could be the kernel's next file's (another tenant's device)."""
    import os
    import threading

    dev = FileBlockDevice(tmp_path / "f.img", block_count=4)
    entered, release = threading.Event(), threading.Event()
    real = os.pwritev

    def slow_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        entered.set()
        release.wait(5)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            dev.write(1, b"x" * 4096)
        except BaseException as e:  # reported below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    assert entered.wait(5)
    dev.close()  # returns at once; the descriptor stays until the write is done
    release.set()
    writer.join(5)
    assert errors == []
    assert (tmp_path / "f.img").read_bytes()[4096:8192] == b"x" * 4096
    with pytest.raises(BlockDeviceError, match="closed"):
        dev.write(0, bytes(4096))


def test_a_file_device_has_one_process_at_a_time(tmp_path: Path) -> None:
    """Two agents given the same [storage] nvme_dir both opened nvme.img and overwrote each
    other's chunks (found only as integrity failures on read): another process is refused."""
    path = tmp_path / "nvme.img"
    first = FileBlockDevice(path, block_count=8)
    probe = (
        "import sys\n"
        "from dpu_agent.blockdev import BlockDeviceError, FileBlockDevice\n"
        "try:\n"
        "    FileBlockDevice(sys.argv[1]).close()\n"
        "except BlockDeviceError as e:\n"
        "    sys.exit(str(e))\n"
    )
    run = [sys.executable, "-c", probe, str(path)]
    other = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and "in use by another process" in other.stderr, other
    first.close()
    assert subprocess.run(run, capture_output=True, timeout=60).returncode == 0  # lock gone
