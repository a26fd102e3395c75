"""Initiator (host_shim.nvme) against the target (dpu_agent.nvmf), both real, across processes.

The target runs as `python -m dpu_agent.nvmf` on 127.0.0.1 with an ephemeral port; a few
tests that need to change the target while it runs use an in-process target on its own
event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from waits import wait_until

from dpu_agent.blockdev import MemoryBlockDevice
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, TargetOptions
from dpu_agent.testing import TargetProcess
from host_shim.nvme import (
    NvmeError,
    NvmeStatusError,
    NvmeTcpBlockDevice,
    NvmeTcpController,
    NvmeTransportError,
    Request,
    discover,
)
from kvproto.nvme import DISCOVERY_NQN, FeatureId, Status
from kvproto.nvme import _commands as cmds

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:acme"
HOST = "nqn.2026-11.io.dpu-kvtier:host:gpu0"
OTHER_HOST = "nqn.2026-11.io.dpu-kvtier:host:intruder"
BLOCKS = 4096


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    with TargetProcess(
        NQN, allow_hosts=[HOST], blocks=BLOCKS, max_io_size=128 << 10, keep_alive_granularity_ms=100
    ) as t:
        yield t
        assert t.alive(), "the target died during the tests"


def _connect(target: TargetProcess, **kw: object) -> NvmeTcpController:
    return NvmeTcpController.connect("127.0.0.1", target.port, NQN, HOST, **kw)  # type: ignore[arg-type]


def test_connect_identify(target: TargetProcess) -> None:
    with _connect(target, io_queues=2) as c:
        assert c.io_queue_count == 2 and 1 <= c.cntlid <= 0xFFEF
        ident = c.identify_controller()
        assert ident.subnqn == NQN and ident.mdts == 5 and ident.cntlid == c.cntlid
        assert ident.ioccsz * 16 - 64 == 4096 and ident.oncs & 0x0C == 0x0C
        assert c.max_transfer_bytes == 128 << 10
        assert c.active_namespaces() == [1]
        ns = c.identify_namespace(1)
        assert (ns.nsze, ns.block_size) == (BLOCKS, 4096)
        assert c.identify_namespace(7).nsze == 0  # inactive: all zeros
        assert c.get_features(FeatureId.NUMBER_OF_QUEUES) == 0x00010001
        c.keep_alive()


def test_data_written_on_one_connection_reads_back_on_another(target: TargetProcess) -> None:
    data = os.urandom(1 << 20)  # 8 commands of MDTS 128 KiB, over 3 queues
    with _connect(target, io_queues=3, queue_depth=4) as a:
        a.write(1, 100, data)
        a.flush(1)
    with _connect(target, io_queues=1) as b:
        out = bytearray(len(data))
        b.read(1, 100, out)
        assert out == data
        arr = np.zeros((64, 4096), dtype=np.uint8)  # any writable buffer works
        b.read(1, 100, arr)
        assert arr.tobytes() == data[: 64 * 4096]


def test_in_capsule_and_r2t_writes_and_small_reads(target: TargetProcess) -> None:
    with _connect(target) as c:
        small, big = os.urandom(4096), os.urandom(3 * 4096)  # in-capsule / R2T
        c.write(1, 10, small)
        c.write(1, 11, big)
        out = bytearray(4 * 4096)
        c.read(1, 10, out)
        assert out == small + big


def test_write_zeroes_and_deallocate(target: TargetProcess) -> None:
    with _connect(target) as c:
        c.write(1, 200, b"\xff" * 8192)
        c.write_zeroes(1, 200, 1)
        c.deallocate(1, 201, 1)
        out = bytearray(8192)
        c.read(1, 200, out)
        assert out == bytes(8192)  # MemoryBlockDevice zeroes deallocated blocks


def test_errors_keep_the_queue_usable(target: TargetProcess) -> None:
    with _connect(target) as c:
        with pytest.raises(NvmeStatusError) as err:
            c.read(1, BLOCKS - 1, bytearray(8192))
        assert err.value.code == Status.LBA_OUT_OF_RANGE and err.value.dnr
        with pytest.raises(NvmeError, match="not active"):
            c.block_size(9)
        req = Request(
            lambda cid: cmds.read(cid=cid, nsid=9, slba=0, nlb=1),
            what="read",
            data_in=memoryview(bytearray(4096)),
        )
        c._io[0].execute([req])
        assert req.cqe is not None and req.cqe.code == Status.INVALID_NAMESPACE
        c.read(1, 0, bytearray(4096))  # the queue still works


def test_mdts_enforced(target: TargetProcess) -> None:
    with _connect(target, io_queues=1) as c:
        q = c._io[0]  # a raw command past MDTS (the controller itself never sends one)
        big = memoryview(bytearray(256 << 10))
        req = Request(
            lambda cid: cmds.read(cid=cid, nsid=1, slba=0, nlb=64), what="read", data_in=big
        )
        q.execute([req])
        assert req.cqe is not None and req.cqe.code == Status.DATA_SGL_LENGTH_INVALID
        c.read(1, 0, bytearray(4096))


def test_host_not_on_allowlist_is_refused(target: TargetProcess) -> None:
    with pytest.raises(NvmeStatusError) as err:
        NvmeTcpController.connect("127.0.0.1", target.port, NQN, OTHER_HOST)
    assert (err.value.sct, err.value.sc) == (1, 0x84)  # Connect: Invalid Host (SPDK's answer)


def test_unknown_subsystem_is_refused(target: TargetProcess) -> None:
    with pytest.raises(NvmeStatusError) as err:
        NvmeTcpController.connect("127.0.0.1", target.port, NQN + "x", HOST)
    assert (err.value.sct, err.value.sc) == (1, 0x82)  # Invalid Parameters
    assert err.value.cqe.cdw0 == 1 | 256 << 16  # IATTR data, IPO = offset of SUBNQN


def test_discovery_lists_only_what_the_host_may_see(target: TargetProcess) -> None:
    entries = discover("127.0.0.1", target.port, HOST)
    assert [(e.subnqn, e.trsvcid, e.traddr, e.trtype) for e in entries] == [
        (NQN, str(target.port), "127.0.0.1", 3)
    ]
    assert discover("127.0.0.1", target.port, OTHER_HOST) == []


def test_discovery_controller_has_no_io_queues(target: TargetProcess) -> None:
    with NvmeTcpController.connect("127.0.0.1", target.port, DISCOVERY_NQN, HOST, io_queues=0) as c:
        assert c.identify_controller().cntrltype == 2
        assert c.io_queue_count == 0


def test_keep_alive_timeout_closes_idle_controller(tmp_path: Path) -> None:
    """An idle controller (no keep-alive) is destroyed after its KATO; one whose host sends
    keep-alives, connected before it, outlives it: the target's own log says when the idle
    one went, so the live one has been through the same windows when it is checked."""
    log = tmp_path / "target.log"
    with TargetProcess(NQN, allow_hosts=[HOST], blocks=BLOCKS, keep_alive_granularity_ms=100,
                       log_level="INFO", log_path=log) as t:  # fmt: skip
        alive = _connect(t, kato_ms=200)  # keep-alive thread every 100 ms
        idle = _connect(t, kato_ms=200, keep_alive=False)  # granularity 100 ms: KATO 200 ms
        try:
            gone = wait_until(
                lambda: _destroyed(log), "the target destroys the idle controller", 20.0
            )
            assert gone == {idle.cntlid: "keep-alive timeout 200 ms"}
            with pytest.raises(NvmeTransportError):
                idle.read(1, 0, bytearray(4096))
            alive.read(1, 0, bytearray(4096))
            assert alive.cntlid not in _destroyed(log)
        finally:
            idle.close()
            alive.close()


def test_a_target_paused_past_the_kato_keeps_its_hosts(tmp_path: Path) -> None:
    """The target stopped (SIGSTOP; a VM pause or starved cores do the same) for longer than a
    host's KATO, then continued: the host did send its keep-alives, the target did not run to
    read them. The KATO counts the time the target ran (dpu_agent/runclock.py), so the host's
    controller lives on; one that sends nothing is still destroyed after its KATO."""
    log = tmp_path / "target.log"
    with TargetProcess(NQN, allow_hosts=[HOST], blocks=BLOCKS, keep_alive_granularity_ms=100,
                       log_level="INFO", log_path=log) as t:  # fmt: skip
        alive = _connect(t, kato_ms=1000)  # keep-alive thread every 500 ms
        try:
            alive.read(1, 0, bytearray(4096))
            for _ in range(3):  # which of the target's tasks runs first on waking varies
                os.kill(t.proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(2.5)
                finally:
                    os.kill(t.proc.pid, signal.SIGCONT)
                time.sleep(0.5)
                alive.read(1, 0, bytearray(4096))
            assert _destroyed(log) == {}
            idle = _connect(t, kato_ms=200, keep_alive=False)
            gone = wait_until(lambda: _destroyed(log), "the idle controller destroyed", 20.0)
            assert gone == {idle.cntlid: "keep-alive timeout 200 ms"}
            idle.close()
        finally:
            alive.close()


def _destroyed(log: Path) -> dict[int, str]:
    """cntlid -> reason of every controller the target's JSON log says it destroyed."""
    out = {}
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("event") == "nvmf_controller_destroyed":
                out[int(rec["cntlid"])] = str(rec["reason"])
    return out


def test_concurrent_threads_on_shared_controller(target: TargetProcess) -> None:
    with _connect(target, io_queues=2, queue_depth=8) as c:
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                data = bytes([i]) * (64 << 10)
                for _ in range(5):
                    c.write(1, 1000 + i * 16, data)
                    out = bytearray(len(data))
                    c.read(1, 1000 + i * 16, out)
                    assert out == data
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors


def test_nvme_tcp_block_device(target: TargetProcess) -> None:
    dev = NvmeTcpBlockDevice(_connect(target), 1)
    try:
        assert (dev.block_size, dev.block_count) == (4096, BLOCKS)
        data = os.urandom(8192)
        dev.write(300, memoryview(data))
        out = bytearray(8192)
        dev.read_into(300, memoryview(out))
        assert out == data
        dev.flush()
        dev.deallocate(300, 2)
    finally:
        dev.close()


def test_digests_negotiated(target: TargetProcess) -> None:
    with _connect(target, hdgst=True, ddgst=True) as c:
        data = os.urandom(64 << 10)
        c.write(1, 500, data)
        out = bytearray(len(data))
        c.read(1, 500, out)
        assert out == data


def test_encrypted_namespace_keeps_only_ciphertext(tmp_path: object) -> None:
    from dpu_agent.crypto import XtsCipher

    key = bytes(range(64))
    path = os.path.join(str(tmp_path), "tier.img")
    plain = (b"KV-CHUNK-PLAINTEXT" * 700)[: 3 * 4096]
    with TargetProcess(NQN, allow_hosts=[HOST], blocks=64, file=path, xts_key=key) as t:
        with NvmeTcpController.connect("127.0.0.1", t.port, NQN, HOST) as c:
            c.write(1, 5, plain)
            c.flush(1)
            out = bytearray(len(plain))
            c.read(1, 5, out)
            assert out == plain
    with open(path, "rb") as f:
        raw = f.read()
    assert b"KV-CHUNK-PLAINTEXT" not in raw
    expected = bytearray(len(plain))
    XtsCipher(key).encrypt_into(plain, expected, 5)  # tweak = LBA, as SPDK's crypto vbdev
    assert raw[5 * 4096 : 8 * 4096] == expected


# -- in-process target: subsystems come and go while it runs ------------------------------


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: object, timeout: float = 10) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def call(self, fn: object, *args: object) -> object:
        async def go() -> object:
            return fn(*args)  # type: ignore[operator]

        return self.run(go())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_subsystems_added_and_removed_while_running() -> None:
    lt = LoopThread()
    tgt = NvmeTcpTarget([], "127.0.0.1", 0, options=TargetOptions(io_workers=2))
    lt.run(tgt.start())
    try:
        assert discover("127.0.0.1", tgt.port, HOST) == []
        sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: MemoryBlockDevice(64)})
        lt.call(tgt.add_subsystem, sub)
        assert [e.subnqn for e in discover("127.0.0.1", tgt.port, HOST)] == [NQN]
        c = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST)
        c.write(1, 0, b"a" * 4096)
        lt.call(tgt.remove_subsystem, NQN)
        with pytest.raises(NvmeTransportError):
            c.read(1, 0, bytearray(4096))
        c.close()
        with pytest.raises(NvmeStatusError):
            NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST)
    finally:
        lt.run(tgt.stop())
        lt.close()


class LendingDevice:
    """A DRAM-like device with the optional MemoryViewDevice capability (`view`)."""

    block_size = 4096
    lends_memory = True
    in_memory = mapped_reads = buffered_writes = False

    def __init__(self, block_count: int) -> None:
        self.block_count = block_count
        self.mem = bytearray(block_count * 4096)
        self.copies = 0  # read_into/write calls: the zero-copy path makes none

    def view(self, lba: int, block_count: int) -> memoryview:
        return memoryview(self.mem)[lba * 4096 : (lba + block_count) * 4096]

    def read_into(self, lba: int, buf: memoryview) -> None:
        self.copies += 1
        buf[:] = self.view(lba, len(buf) // 4096)

    def write(self, lba: int, data: memoryview | bytes) -> None:
        self.copies += 1
        self.view(lba, len(data) // 4096)[:] = data

    def flush(self) -> None:
        pass

    def deallocate(self, lba: int, block_count: int) -> None:
        self.view(lba, block_count)[:] = bytes(block_count * 4096)

    def close(self) -> None:
        pass


def test_zero_copy_through_a_memory_view_device() -> None:
    dev = LendingDevice(256)
    lt = LoopThread()
    sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: dev})  # type: ignore[dict-item]
    tgt = NvmeTcpTarget([sub], "127.0.0.1", 0)
    lt.run(tgt.start())
    try:
        with NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST, queue_depth=4) as c:
            data = os.urandom(512 << 10)  # R2T writes of MDTS 128 KiB: straight into dev.mem
            c.write(1, 16, data)
            assert dev.mem[16 * 4096 : 16 * 4096 + len(data)] == data and dev.copies == 0
            out = bytearray(len(data))
            c.read(1, 16, out)  # C2HData sent from dev.mem
            assert out == data and dev.copies == 0
            c.write(1, 0, b"s" * 4096)  # in-capsule: through write()
            assert dev.copies == 1 and dev.mem[:4096] == b"s" * 4096
    finally:
        lt.run(tgt.stop())
        lt.close()


def test_in_capsule_write_without_its_data_is_refused(target: TargetProcess) -> None:
    with _connect(target) as c:
        req = Request(
            lambda cid: cmds.write(cid=cid, nsid=1, slba=0, nlb=1, in_capsule=True),
            what="write without data",
        )
        c._io[0].execute([req])
        assert req.cqe is not None and req.cqe.code == Status.DATA_SGL_LENGTH_INVALID
        c.read(1, 0, bytearray(4096))


def test_silent_target_times_out() -> None:
    import socket as socketlib

    srv = socketlib.create_server(("127.0.0.1", 0))
    accepted: list[socketlib.socket] = []
    th = threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True)
    th.start()
    start = time.monotonic()
    try:
        with pytest.raises(NvmeTransportError, match="no answer"):
            NvmeTcpController.connect("127.0.0.1", srv.getsockname()[1], NQN, HOST, timeout_s=0.5)
        assert time.monotonic() - start < 5
    finally:
        th.join(5)
        for s in accepted:
            s.close()
        srv.close()
