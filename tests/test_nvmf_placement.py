"""Where the NVMe/TCP target runs each I/O is decided from the device's declared I/O traits
(BlockDevice: in_memory, lends_memory, mapped_reads, buffered_writes) in one module,
dpu_agent/nvmf/_placement.py, not by probing undeclared attributes with getattr."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from dpu_agent.blockdev import BlockDevice, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice
from dpu_agent.nvmf import _placement as placement
from dpu_agent.spdk_mode import SpdkNamespace
from host_shim.nvme import NvmeTcpBlockDevice
from kvproto.nvme import IoOpcode

ROOT = Path(__file__).resolve().parents[1]
TRAITS = ("in_memory", "lends_memory", "mapped_reads", "buffered_writes")


class _Traits:
    """A device that is nothing but its declared traits (placement reads nothing else)."""

    block_size, block_count = 4096, 1

    def __init__(self, in_memory: bool, lends: bool, mapped: bool, buffered: bool) -> None:
        self.in_memory, self.lends_memory = in_memory, lends
        self.mapped_reads, self.buffered_writes = mapped, buffered


def _expected(mem: bool, lends: bool, mapped: bool, buffered: bool, op: int) -> tuple[str, bool]:
    """The placement table, written out: (where, watched for the kernel throttling it)."""
    if op == IoOpcode.READ:
        if mem and lends:
            return "inline", False  # a memcpy out of the device's own bytes
        if mem or mapped:
            return "memory lane", False  # a cipher pass out of memory or the page cache
        return "pool", False  # a preadv or a round trip: may wait on a disk
    if op == IoOpcode.WRITE:
        if mem:
            return "inline", False  # a memcpy or one cipher pass into memory
        if buffered:
            return "inline", True  # a copy into the page cache: back off when throttled
        return "pool", False
    return "pool", False  # Flush, Write Zeroes, DSM: long or blocking, never on the loop


@pytest.mark.parametrize(
    ("mem", "lends", "mapped", "buffered"), list(itertools.product([False, True], repeat=4))
)
@pytest.mark.parametrize(
    "op", [IoOpcode.READ, IoOpcode.WRITE, IoOpcode.WRITE_ZEROES, IoOpcode.FLUSH]
)
def test_placement_follows_the_declared_traits(
    mem: bool, lends: bool, mapped: bool, buffered: bool, op: int
) -> None:
    dev: BlockDevice = _Traits(mem, lends, mapped, buffered)  # type: ignore[assignment]
    where, watched = _expected(mem, lends, mapped, buffered, op)
    if placement.inline(dev, op):
        got = "inline"
    elif placement.memory_lane(dev, op):
        got = "memory lane"
    else:
        got = "pool"
    assert (got, placement.page_cache_write(dev, op) and got == "inline") == (where, watched)
    assert placement.lends_memory(dev) is lends


@pytest.mark.parametrize(
    "cls",
    [MemoryBlockDevice, FileBlockDevice, CryptoBlockDevice, NvmeTcpBlockDevice, SpdkNamespace],
)
def test_every_block_device_declares_its_io_traits(cls: type) -> None:
    """A device missing a trait would fail at its first I/O through the target (AttributeError),
    not quietly fall back to the pool as the getattr probes did."""
    missing = [t for t in TRAITS if not hasattr(cls, t)]
    assert not missing, f"{cls.__name__} does not declare {missing}"


def test_the_tiers_are_placed_as_measured(tmp_path: Path) -> None:
    from dpu_agent.crypto import XtsCipher

    key = XtsCipher(bytes(range(64)))
    dram = MemoryBlockDevice(8)
    enc_dram = CryptoBlockDevice(MemoryBlockDevice(8), key)
    file = FileBlockDevice(tmp_path / "f.img", block_count=8)
    enc_file = CryptoBlockDevice(FileBlockDevice(tmp_path / "e.img", block_count=8), key)
    try:
        assert placement.inline(dram, IoOpcode.READ) and placement.lends_memory(dram)
        assert placement.inline(enc_dram, IoOpcode.WRITE)
        assert placement.memory_lane(enc_dram, IoOpcode.READ)
        assert not placement.lends_memory(enc_dram)  # ciphertext in the device, plaintext out
        assert placement.page_cache_write(file, IoOpcode.WRITE)
        assert not placement.memory_lane(file, IoOpcode.READ)  # preadv: may wait on the disk
        assert placement.page_cache_write(enc_file, IoOpcode.WRITE)
        assert placement.memory_lane(enc_file, IoOpcode.READ)  # mapped page cache
    finally:
        for d in (dram, enc_dram, file, enc_file):
            d.close()


def test_connection_probes_no_undeclared_device_capability() -> None:
    src = (ROOT / "dpu_agent/nvmf/_connection.py").read_text()
    calls = [
        n.lineno
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
    ]
    assert not calls, f"getattr probes at lines {calls} of nvmf/_connection.py"
