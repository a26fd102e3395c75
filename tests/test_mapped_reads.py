"""Issue 9, the NVMe tier's reads: decrypted straight out of the tier file's page cache (a
read-only mapping) instead of preadv into the buffer and a cipher pass over it, with a page the
kernel cannot supply (SIGBUS) turned into a fallback to preadv, not a dead agent."""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disk_dirs import disk_backed_dir

from dpu_agent.blockdev import FileBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
from dpu_agent.nvmf import NvmeTcpTarget
from dpu_agent.nvmf import _target as target_module

KEY = bytes(range(64))
BS = 4096
REPO = Path(__file__).resolve().parent.parent
LANE_BACK_S = 10.0  # deadline for the lane to take work again after its back-off (loaded box)


@pytest.fixture
def disk_path() -> Iterator[Path]:
    """A directory on a real disk: the page-cache tests need pages that DONTNEED can drop."""
    where = disk_backed_dir("mapped-reads-")
    if where is None:
        pytest.skip("no disk-backed directory (the repo's .pytest-disk/ and /var/tmp are tmpfs)")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_reads_decrypt_out_of_the_mapping_without_preadv(tmp_path: Path) -> None:
    dev = CryptoBlockDevice(FileBlockDevice(tmp_path / "t.img", block_count=64), XtsCipher(KEY))
    try:
        data = os.urandom(16 * BS)
        dev.write(8, data)
        assert dev.mapped_reads

        def no_preadv(lba: int, buf: memoryview) -> None:
            raise AssertionError("read through preadv, not the mapping")

        dev.base.read_into = no_preadv  # type: ignore[method-assign]
        out = bytearray(16 * BS)
        dev.read_into(8, memoryview(out))
        assert out == data
        dev.write(12, bytes(4 * BS))  # a later write is seen through the mapping (one cache)
        dev.read_into(8, memoryview(out))
        assert out == data[: 4 * BS] + bytes(4 * BS) + data[8 * BS :]
    finally:
        dev.close()


def test_a_file_that_cannot_be_mapped_reads_through_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    def refuse(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(19, "No such device")  # what mmap says of a file system without it

    monkeypatch.setattr(mmap, "mmap", refuse)
    base = FileBlockDevice(tmp_path / "t.img", block_count=16)
    dev = CryptoBlockDevice(base, XtsCipher(KEY))
    try:
        assert base.mapped(0, 1) is None
        data = os.urandom(4 * BS)
        dev.write(2, data)
        out = bytearray(4 * BS)
        dev.read_into(2, memoryview(out))
        assert out == data
    finally:
        dev.close()


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_file_cut_short_under_the_mapping_is_a_fallback_not_a_sigbus(tmp_path: Path) -> None:
    """A page past the end of a file cut short (as an I/O error) raises SIGBUS in the reading
    thread; unguarded, that ends the agent (the child dies with -SIGBUS). Guarded, the read
    goes to preadv, which sees the file's end."""
    r = run_child(
        f"""
        import os
        from dpu_agent.blockdev import FileBlockDevice
        from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
        base = FileBlockDevice({str(tmp_path / "t.img")!r}, block_count=64)
        dev = CryptoBlockDevice(base, XtsCipher({KEY!r}))
        data = os.urandom(16 * {BS})
        dev.write(0, data)
        out = bytearray(16 * {BS})
        dev.read_into(0, memoryview(out)); assert out == data
        os.truncate(base.path, 4 * {BS})  # pages 4.. of the mapping are gone
        calls = []
        read_into = base.read_into
        base.read_into = lambda lba, buf: (calls.append(lba), read_into(lba, buf))
        dev.read_into(0, memoryview(out))
        assert calls == [0], calls  # the mapped pass failed over to preadv
        assert out[: 4 * {BS}] == data[: 4 * {BS}]
        print("survived")
        """
    )
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_sigbus_outside_a_guarded_read_still_ends_the_process(tmp_path: Path) -> None:
    """The guard catches only its own reads: any other SIGBUS keeps its default action."""
    r = run_child(
        f"""
        import mmap, os
        from dpu_agent.crypto import XtsCipher
        c = XtsCipher({KEY!r})
        path = {str(tmp_path / "u.img")!r}
        with open(path, "wb") as f:
            f.truncate(8 * {BS})
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, 8 * {BS}, prot=mmap.PROT_READ)
        out = bytearray(8 * {BS})
        assert c.decrypt_mapped_into(memoryview(m), out, 0)  # the guard is installed now
        os.truncate(path, 0)
        print("before", flush=True)
        m[5 * {BS}]  # unguarded read of a page that is gone
        print("after")
        """
    )
    assert r.returncode == -7 and "before" in r.stdout and "after" not in r.stdout, (
        r.returncode, r.stdout, r.stderr[-2000:],
    )  # fmt: skip


def test_a_lane_read_that_waited_for_the_disk_sends_the_lane_to_the_pool_for_a_while(
    disk_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapped read whose pages are not cached waits on the disk (a major page fault); in the
    one-thread lane it would hold up every read behind it. After one, the lane's work goes to
    the pool (LANE_BACKOFF_S), then back to the lane. A call that is merely slow (waiting for
    the GIL or the CPU, as on a loaded box) keeps the lane."""
    backoff_s = 1.0  # long enough that the first call after the disk read lands inside it
    monkeypatch.setattr(target_module, "LANE_BACKOFF_S", backoff_s)
    cold = disk_path / "cold.img"
    with open(cold, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache

    async def main() -> tuple[list[str], int, list[tuple[float, str]]]:
        target = NvmeTcpTarget((), "127.0.0.1", 0)
        await target.start()
        ran_in: list[str] = []
        faults: list[int] = []

        async def one(work: Callable[[], None]) -> None:
            done = asyncio.Event()

            def cb(exc: Exception | None) -> None:
                assert exc is None
                done.set()

            target.submit_io(cb, work, memory=True)
            await asyncio.wait_for(done.wait(), 10)

        def fast() -> None:
            ran_in.append(threading.current_thread().name)

        def slow() -> None:  # no disk: the CPU or the GIL
            ran_in.append(threading.current_thread().name)
            time.sleep(0.02)

        def from_disk() -> None:
            ran_in.append(threading.current_thread().name)
            before = target_module._major_faults()
            with open(cold, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                m[1 << 20]  # a page that is not cached
            faults.append(target_module._major_faults() - before)

        # (seconds from the start of the disk read to the end of a call, where it ran): a call
        # that ended within the back-off of that start was placed inside the back-off
        later: list[tuple[float, str]] = []
        try:
            await one(slow)
            await one(fast)  # slow is no reason to leave
            disk_start = time.monotonic()
            await one(from_disk)
            while time.monotonic() < disk_start + LANE_BACK_S:  # until the lane takes it again
                await one(fast)
                later.append((time.monotonic() - disk_start, ran_in.pop()))
                if later[-1][1].startswith("nvmf-mem"):
                    break
                await asyncio.sleep(0.02)
        finally:
            await target.stop()
        return ran_in, faults[0], later

    ran_in, faults, later = asyncio.run(main())
    assert faults > 0, f"{disk_path} kept the dropped pages: no major fault, nothing to test"
    kinds = [name.split("_")[0] for name in ran_in]
    assert kinds == ["nvmf-mem", "nvmf-mem", "nvmf-mem"], ran_in
    assert later and later[-1][1].startswith("nvmf-mem"), f"never back in the lane: {later}"
    assert later[-1][0] >= backoff_s, later  # not before the back-off was over
    early = [where for after, where in later if after < backoff_s]  # inside the back-off
    assert early and all(w.startswith("nvmf-io") for w in early), later


def _thread_major_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


def test_drop_cache_sends_mapped_reads_back_to_the_disk(disk_path: Path) -> None:
    """The failure: the two-tier replay measured the NVMe tier's bandwidth 'from the disk' by
    posix_fadvise(DONTNEED) before each round, but since reads come out of the tier file's
    mapping the pages an earlier round read stay mapped, fadvise cannot drop them, and the
    NVMe tier measured 18 GB/s against 10 for DRAM. `drop_cache()` unmaps them first; the
    replay's bandwidth rounds use it, so every round reads from the disk."""
    from dpu_agent.bench.replay_tiers import _read_gbps

    path = disk_path / "nvme.img"
    blocks = (64 << 20) // BS  # what _read_gbps reads
    dev = FileBlockDevice(str(path), blocks)
    crypto = CryptoBlockDevice(dev, XtsCipher(KEY))
    try:
        chunk = os.urandom(4 << 20)
        for lba in range(0, blocks, len(chunk) // BS):
            crypto.write(lba, chunk)
        crypto.flush()
        dev.drop_cache()
        before = _thread_major_faults()
        _read_gbps(crypto, None)  # cold: from the disk
        assert _thread_major_faults() > before, f"{disk_path} kept the dropped pages in memory"
        before = _thread_major_faults()
        _read_gbps(crypto, None)  # the pages are mapped and cached now: no disk
        assert _thread_major_faults() == before
        os.posix_fadvise(dev._fd, 0, 0, os.POSIX_FADV_DONTNEED)  # what the replay did
        before = _thread_major_faults()
        _read_gbps(crypto, None)
        assert _thread_major_faults() == before  # still cached: fadvise skips mapped pages
        before = _thread_major_faults()
        _read_gbps(crypto, dev)  # as the replay's rounds do now: drop_cache() first
        # from the disk again (a fault's readahead brings in the pages after it: one or more)
        assert _thread_major_faults() > before
    finally:
        crypto.close()
