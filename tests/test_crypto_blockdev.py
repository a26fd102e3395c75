"""CryptoBlockDevice: only ciphertext reaches the base device; reads give plaintext back."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpu_agent.blockdev import BlockDevice, BlockDeviceError, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import SCRATCH_BYTES_MAX, CryptoBlockDevice, XtsCipher

KEY = bytes(range(64))
PATTERN = b"PLAINTEXT-KV-CHUNK-MARKER-0123456789abcdef"


def _pattern(nbytes: int) -> bytes:
    return (PATTERN * (nbytes // len(PATTERN) + 1))[:nbytes]


def test_file_holds_ciphertext_and_reads_back_plaintext(tmp_path: Path) -> None:
    path = tmp_path / "tier.img"
    dev = CryptoBlockDevice(FileBlockDevice(path, block_count=64), XtsCipher(KEY))
    assert isinstance(dev, BlockDevice)
    data = _pattern(4096 * 5)
    dev.write(3, data)
    dev.flush()
    raw = path.read_bytes()
    assert PATTERN[:16] not in raw
    # Sector 3 on disk is exactly XTS(key, tweak=LBA 3) of the plaintext, as SPDK writes it.
    enc = Cipher(algorithms.AES(KEY), modes.XTS(struct.pack("<QQ", 0, 3))).encryptor()
    assert raw[3 * 4096 : 4 * 4096] == enc.update(data[:4096]) + enc.finalize()
    buf = bytearray(len(data))
    dev.read_into(3, memoryview(buf))
    assert bytes(buf) == data
    dev.close()


def test_reopened_device_reads_old_data(tmp_path: Path) -> None:
    path = tmp_path / "tier.img"
    data = _pattern(8192)
    dev = CryptoBlockDevice(FileBlockDevice(path, block_count=16), XtsCipher(KEY))
    dev.write(10, data)
    dev.close()
    again = CryptoBlockDevice(FileBlockDevice(path), XtsCipher(KEY))
    buf = bytearray(8192)
    again.read_into(10, memoryview(buf))
    assert bytes(buf) == data
    wrong = CryptoBlockDevice(FileBlockDevice(path), XtsCipher(bytes(range(64, 128))))
    wrong.read_into(10, memoryview(buf))
    assert bytes(buf) != data
    again.close()
    wrong.close()


def test_write_larger_than_scratch_and_caller_data_untouched() -> None:
    block_count = SCRATCH_BYTES_MAX // 4096 * 2 + 8
    dev = CryptoBlockDevice(MemoryBlockDevice(block_count), XtsCipher(KEY))
    data = np.random.default_rng(7).integers(0, 256, (block_count - 4) * 4096, dtype=np.uint8)
    before = data.tobytes()
    dev.write(2, data.data)
    assert data.tobytes() == before
    raw = bytearray(len(before))
    dev.base.read_into(2, memoryview(raw))
    expected = bytearray(len(before))
    XtsCipher(KEY).encrypt_into(before, expected, 2)
    assert raw == expected
    out = np.empty_like(data)
    dev.read_into(2, out.data)
    assert out.tobytes() == before


def test_out_of_range_io_rejected() -> None:
    dev = CryptoBlockDevice(MemoryBlockDevice(4), XtsCipher(KEY))
    with pytest.raises(BlockDeviceError, match="outside device"):
        dev.write(3, bytes(8192))
    with pytest.raises(BlockDeviceError, match="multiple of 4096"):
        dev.read_into(0, memoryview(bytearray(100)))


def test_block_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        CryptoBlockDevice(MemoryBlockDevice(4), XtsCipher(KEY, block_size=512))


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    dev = CryptoBlockDevice(FileBlockDevice(tmp_path / "t.img", block_count=256), XtsCipher(KEY))
    errors: list[str] = []

    def work(index: int) -> None:
        lba = index * 32
        data = os.urandom(32 * 4096)
        buf = bytearray(len(data))
        for _ in range(25):
            dev.write(lba, data)
            dev.read_into(lba, memoryview(buf))
            if buf != data:
                errors.append(f"thread {index} read back other bytes")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    dev.close()


class _NoView:
    """A MemoryBlockDevice without its `view` capability: the copy path."""

    in_memory = lends_memory = mapped_reads = buffered_writes = False

    def __init__(self, base: MemoryBlockDevice) -> None:
        self.base, self.block_size, self.block_count = base, base.block_size, base.block_count

    def read_into(self, lba: int, buf: memoryview) -> None:
        self.base.read_into(lba, buf)

    def write(self, lba: int, data: memoryview | bytes) -> None:
        self.base.write(lba, data)


def test_memory_base_encrypts_in_place_with_the_same_ciphertext() -> None:
    """Over a base that lends its memory (the DRAM tier) the cipher writes into and reads out
    of it directly (one pass, no copy); the stored bytes are those of the copy path."""
    key, data = os.urandom(64), os.urandom(300 * 4096)
    lending, copying = MemoryBlockDevice(512), MemoryBlockDevice(512)
    a = CryptoBlockDevice(lending, XtsCipher(key))
    b = CryptoBlockDevice(_NoView(copying), XtsCipher(key))  # type: ignore[arg-type]
    a.write(7, data)
    b.write(7, data)
    assert lending.view(0, 512) == copying.view(0, 512) and lending.view(7, 1) != data[:4096]
    out = bytearray(len(data))
    a.read_into(7, memoryview(out))
    assert out == data
    with pytest.raises(BlockDeviceError):
        a.read_into(510, memoryview(bytearray(3 * 4096)))  # past the end: refused, not clipped


def test_the_write_scratch_is_one_per_thread_not_one_per_device(tmp_path: Path) -> None:
    """Each device kept its own 4 MiB scratch per writing thread: 100 tenants with one chunk
    each held 425 MiB (an attack pass). Forty devices written by one thread now share one."""
    import tracemalloc

    devices = [
        CryptoBlockDevice(FileBlockDevice(tmp_path / f"{i}.img", block_count=4), XtsCipher(KEY))
        for i in range(40)
    ]
    devices[0].write(0, bytes(4096))  # this thread's scratch, before counting
    tracemalloc.start()
    try:
        for dev in devices:
            dev.write(1, b"y" * 4096)
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        for dev in devices:
            dev.close()
    assert grown < SCRATCH_BYTES_MAX, grown  # one device's scratch each was 160 MiB
