"""Issue 9, the 0.8x target: target data buffers are reused, never lost to idle queues, and
the DRAM tier's encrypted I/O counts as memory work (run inline by the target)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dpu_agent.blockdev import FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
from dpu_agent.nvmf._limits import QUEUE_CACHE_BYTES_MAX, BufferBudget, SizedPool
from dpu_agent.nvmf._placement import inline, memory_lane
from dpu_agent.nvmf._subsystem import TargetOptions
from kvproto.nvme import IoOpcode

MIB = 1 << 20


def test_queue_at_depth_8_of_1_mib_reuses_every_buffer() -> None:
    """With a 4 MiB cache, half of a QD8 x 1 MiB queue's buffers were new bytearrays (zeroed
    and page-faulted) on every command."""
    opts = TargetOptions(max_io_size=MIB)  # what the agent and `python -m dpu_agent.nvmf` use
    assert QUEUE_CACHE_BYTES_MAX >= opts.data_buffers_per_queue * MIB
    pool = SizedPool(MIB, opts.data_buffers_per_queue)
    bufs = [pool.take(MIB) for _ in range(8)]
    assert all(b is not None for b in bufs)
    for b in bufs:
        assert b is not None
        pool.give(b)
    again = [pool.take(MIB) for _ in range(8)]
    assert {id(b) for b in again} == {id(b) for b in bufs}  # the same eight, none new


def test_queue_short_of_room_takes_back_idle_caches_of_other_queues() -> None:
    """Buffers cached by idle queues stay charged to the controller's budget; a queue that
    needs room must not wait on them forever (it did: nothing refunds an idle cache)."""
    budget = BufferBudget(bytes_max=4 * MIB)
    idle, busy = SizedPool(MIB, 8), SizedPool(MIB, 8)
    idle.attach(budget)
    busy.attach(budget)
    held = [idle.take(MIB) for _ in range(4)]
    for b in held:
        assert b is not None
        idle.give(b)  # idle now: 4 MiB cached, the whole budget
    assert budget.used == 4 * MIB and idle.cached_bytes == 4 * MIB
    assert busy.can_take(MIB)
    got = busy.take(MIB)
    assert got is not None and budget.used <= 4 * MIB
    assert idle.cached_bytes == 0
    busy.give(got)
    busy.close([])
    idle.close([])
    assert budget.used == 0


def test_closed_queue_leaves_the_budget_pools() -> None:
    budget = BufferBudget(bytes_max=4 * MIB)
    pool = SizedPool(MIB, 8)
    pool.attach(budget)
    assert pool in budget.pools
    pool.close([])
    assert pool not in budget.pools


@pytest.mark.parametrize("lends", [True, False])
def test_target_writes_both_encrypted_tiers_inline_and_reads_neither(
    tmp_path: Path, lends: bool
) -> None:
    """Writes: one cipher pass into the DRAM tier, or a cipher pass and a page-cache copy into
    the file tier (tests/test_nvmf_inline_writes.py: the file tier's back-off)."""
    base = MemoryBlockDevice(64) if lends else FileBlockDevice(tmp_path / "n.img", block_count=64)
    dev = CryptoBlockDevice(base, XtsCipher(bytes(range(64))))
    try:
        assert dev.in_memory is lends
        assert inline(dev, IoOpcode.WRITE)
        assert not inline(dev, IoOpcode.READ)  # decrypts on the other core while sending
        # Reads of both are a cipher pass out of memory (the DRAM tier's, or the file tier's
        # page cache through its mapping): one lane (tests/test_mapped_reads.py).
        assert memory_lane(dev, IoOpcode.READ)
        assert not memory_lane(dev, IoOpcode.WRITE_ZEROES)
        assert inline(MemoryBlockDevice(8), IoOpcode.READ)
    finally:
        dev.close()


def test_pool_io_reports_result_and_exception_on_the_loop_thread() -> None:
    """submit_io: one call back per command, on the loop, with the device's exception."""
    import asyncio
    import threading

    from dpu_agent.blockdev import BlockDeviceError
    from dpu_agent.nvmf import NvmeTcpTarget

    async def main() -> list[tuple[str, object, bool]]:
        target = NvmeTcpTarget((), "127.0.0.1", 0)
        await target.start()
        got: list[tuple[str, object, bool]] = []
        finished = asyncio.Event()
        ran_in: list[str] = []

        def ok() -> None:
            ran_in.append(threading.current_thread().name)

        def bad() -> None:
            raise BlockDeviceError("media error")

        def done(name: str) -> Callable[[Exception | None], None]:
            def cb(exc: Exception | None) -> None:
                got.append((name, exc, threading.current_thread() is threading.main_thread()))
                if len(got) == 2:
                    finished.set()

            return cb

        try:
            target.submit_io(done("ok"), ok)
            target.submit_io(done("bad"), bad)
            await asyncio.wait_for(finished.wait(), 10)
        finally:
            await target.stop()
        assert ran_in and ran_in[0].startswith("nvmf-io")  # not on the loop
        return sorted(got, key=lambda g: str(g[0]))

    (bad_name, bad_exc, bad_loop), (ok_name, ok_exc, ok_loop) = asyncio.run(main())
    assert (bad_name, ok_name) == ("bad", "ok")
    assert isinstance(bad_exc, BlockDeviceError) and ok_exc is None
    assert bad_loop and ok_loop


def test_memory_lane_runs_in_arrival_order_on_its_own_thread() -> None:
    """Reads of the encrypted DRAM tier are decrypted by one lane thread in the order they
    came (the order the loop sends them); four pool threads decrypting at once on two vCPUs
    preempted the loop's sends (issue 9, 1 MiB QD8 reads)."""
    import asyncio
    import threading
    import time

    from dpu_agent.nvmf import NvmeTcpTarget

    async def main() -> tuple[list[int], set[str], list[int]]:
        target = NvmeTcpTarget((), "127.0.0.1", 0)
        await target.start()
        ran: list[int] = []
        threads: set[str] = set()
        done: list[int] = []
        finished = asyncio.Event()

        def work(i: int) -> None:
            time.sleep(0.002 * (8 - i))  # earlier ones take longer: a pool would reorder
            ran.append(i)
            threads.add(threading.current_thread().name)

        def cb(i: int) -> Callable[[Exception | None], None]:
            def f(exc: Exception | None) -> None:
                assert exc is None
                done.append(i)
                if len(done) == 8:
                    finished.set()

            return f

        try:
            for i in range(8):
                target.submit_io(cb(i), work, i, memory=True)
            await asyncio.wait_for(finished.wait(), 10)
        finally:
            await target.stop()
        return ran, threads, done

    ran, threads, done = asyncio.run(main())
    assert ran == list(range(8)) and done == list(range(8))
    assert len(threads) == 1 and threads.pop().startswith("nvmf-mem")
