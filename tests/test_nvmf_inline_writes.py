"""Issue 9, writes at 1 MiB QD8: the target writes a page-cache device on its loop (no thread
hops), sends a queue's writes to the I/O pool after one that the kernel made wait, and sends
an R2T at once instead of corking it until the end of the loop turn."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.blockdev import FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, TargetOptions
from dpu_agent.nvmf import _connection as nvmf_connection
from dpu_agent.nvmf._placement import inline, page_cache_write
from host_shim.nvme import NvmeTcpController
from kvproto.nvme import R2T, ICReq, ICResp, IoOpcode, QueuePair, Role
from kvproto.nvme import _commands as cmds

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:inline"
HOST = "nqn.2026-11.io.dpu-kvtier:host:gpu0"
KEY = bytes(range(64))
INLINE_AGAIN_S = 10.0  # deadline for writes to go inline again after the back-off (loaded box)


def test_file_tier_writes_run_inline_and_its_reads_do_not(tmp_path: Path) -> None:
    dev = CryptoBlockDevice(FileBlockDevice(tmp_path / "n.img", block_count=64), XtsCipher(KEY))
    dram = CryptoBlockDevice(MemoryBlockDevice(64), XtsCipher(KEY))
    try:
        assert dev.buffered_writes and not dram.buffered_writes
        assert inline(dev, IoOpcode.WRITE) and page_cache_write(dev, IoOpcode.WRITE)
        assert not inline(dev, IoOpcode.READ)  # preadv + decrypt: the pool, beside the send
        assert not page_cache_write(dev, IoOpcode.READ)
        assert not page_cache_write(dram, IoOpcode.WRITE)  # memory work: never backs off
    finally:
        dev.close()
        dram.close()


class ThrottledDevice:
    """A page-cache-like device whose first `slow` writes take `delay_s` (a kernel throttling
    the writer); records the thread each write ran on."""

    block_size = 4096
    in_memory = lends_memory = mapped_reads = False
    buffered_writes = True

    def __init__(self, block_count: int, slow: int, delay_s: float) -> None:
        self.block_count = block_count
        self.mem = MemoryBlockDevice(block_count)
        self.slow, self.delay_s = slow, delay_s
        self.threads: list[str] = []

    def read_into(self, lba: int, buf: memoryview) -> None:
        self.mem.read_into(lba, buf)

    def write(self, lba: int, data: memoryview | bytes) -> None:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) <= self.slow:
            time.sleep(self.delay_s)
        self.mem.write(lba, data)

    def flush(self) -> None:
        pass

    def deallocate(self, lba: int, block_count: int) -> None:
        self.mem.deallocate(lba, block_count)

    def close(self) -> None:
        self.mem.close()


@pytest.fixture
def served() -> Iterator[tuple[ThrottledDevice, int, str]]:
    dev = ThrottledDevice(1024, slow=1, delay_s=0.05)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="target-loop", daemon=True)
    thread.start()
    sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: dev})
    tgt = NvmeTcpTarget([sub], "127.0.0.1", 0, options=TargetOptions(io_workers=2))
    asyncio.run_coroutine_threadsafe(tgt.start(), loop).result(10)
    try:
        yield dev, tgt.port, thread.name
    finally:
        asyncio.run_coroutine_threadsafe(tgt.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        dev.close()


def test_slow_inline_write_sends_the_queue_to_the_pool_then_back(
    served: tuple[ThrottledDevice, int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the guard every write of a throttled page cache stalls the loop, and every
    queue of every host with it."""
    backoff_s = 0.5
    monkeypatch.setattr(nvmf_connection, "INLINE_BACKOFF_S", backoff_s)
    dev, port, loop_name = served
    data = bytes(range(256)) * 16 * 4  # 16 KiB
    with NvmeTcpController.connect("127.0.0.1", port, NQN, HOST, io_queues=1) as c:
        slow_start = time.monotonic()  # the back-off starts after this (when the write ends)
        c.write(1, 0, data)  # inline, and slow: 50 ms > INLINE_WRITE_SLOW_S
        assert dev.threads == [loop_name]
        # (seconds from the slow write's start to the end of a write, the thread it ran on):
        # a write that ended within the back-off of that start was placed inside the back-off
        later: list[tuple[float, str]] = []
        lba = 4
        while time.monotonic() < slow_start + INLINE_AGAIN_S:  # until writes go inline again
            c.write(1, lba, data)
            later.append((time.monotonic() - slow_start, dev.threads[-1]))
            lba += 4
            if later[-1][1] == loop_name or lba + 4 > dev.block_count:
                break
            time.sleep(0.02)
        assert later and later[-1][1] == loop_name, f"never inline again: {later}"
        assert later[-1][0] >= backoff_s, later  # not before the back-off was over
        early = [thread for after, thread in later if after < backoff_s]
        assert early and all(t.startswith("nvmf-io") for t in early), later
        got = bytearray(len(data))
        for at in range(0, lba, 4):  # every write above, back
            c.read(1, at, got)
            assert got == data


class _Transport:
    """What the connection writes, in order (no socket: `_fd` stays -1)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class _Target:
    options = TargetOptions()

    def connection_opened(self, conn: object) -> None:
        pass

    def connection_closed(self, conn: object) -> None:
        pass


def _feed(conn: nvmf_connection.NvmfConnection, data: bytes) -> None:
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def test_r2t_leaves_before_the_loop_turn_ends() -> None:
    """A corked R2T waited behind the rest of the loop turn (an inline write's cipher pass,
    the next PDU's parse) while the host's data waited on it: the host idled 24-30 % of a
    1 MiB QD8 write run."""

    async def main() -> None:
        conn = nvmf_connection.NvmfConnection(_Target())  # type: ignore[arg-type]
        transport = _Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        host = QueuePair(Role.HOST)
        _feed(
            conn,
            b"".join(
                bytes(p) for p in host.send(ICReq(hpda=0, hdgst=False, ddgst=False, maxr2t=0))
            ),
        )
        await asyncio.sleep(0)  # the ICResp is corked until the end of the turn
        before = b"".join(transport.written)
        transport.written.clear()
        cmd = nvmf_connection._Cmd(cmds.write(cid=7, nsid=1, slba=0, nlb=2))
        cmd.dev, cmd.slba, cmd.nlb, cmd.length = MemoryBlockDevice(8), 0, 2, 8192
        conn._cmds[7] = cmd
        conn._start(cmd)
        assert transport.written, "the R2T waits for the end of the loop turn"
        wire = before + b"".join(transport.written)
        view = host.get_buffer(len(wire))
        view[: len(wire)] = wire
        host.buffer_updated(len(wire))
        assert isinstance(host.next_event(), ICResp)
        r2t = host.next_event()
        assert isinstance(r2t, R2T) and (r2t.cccid, r2t.r2tl) == (7, 8192)
        conn.close()

    asyncio.run(main())
