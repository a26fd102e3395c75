"""Regression tests for what SPDK v26.05 found in the target and initiator (issue 9).

Each reproduces the peer's behaviour with the project's own initiator driven the way SPDK
drives it, so it runs without SPDK; tests/test_nvme_spdk_interop.py runs SPDK itself.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
from test_nvme_target import LoopThread

from dpu_agent.blockdev import MemoryBlockDevice
from dpu_agent.nvmf import Controller, NvmeTcpTarget, Subsystem
from dpu_agent.nvmf._controller import Completion
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeTcpController, Request
from host_shim.nvme import _controller as host_controller
from kvproto.nvme import Property, Sqe
from kvproto.nvme import _commands as cmds

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:regress"
HOST = "nqn.2026-11.io.dpu-kvtier:host:regress"
BLOCKS = 1024
BS = 4096


def _stamp(lba: int) -> bytes:
    """4 KiB whose every 8 bytes name the LBA: a block read from elsewhere cannot pass."""
    return struct.pack("<Q", lba) * (BS // 8)


def test_pipelined_small_reads_of_encrypted_namespace_return_their_own_bytes() -> None:
    """Finding 1: SPDK's bdevperf -w verify -o 4096 -q 8 saw another command's bytes.

    Small C2HData PDUs were corked by reference into a pooled buffer that went back to the
    pool before the flush; the next read decrypted into it. Many 4 KiB reads in flight per
    queue (as bdevperf keeps them) against an encrypted namespace reproduce it.
    """
    with (
        TargetProcess(NQN, allow_hosts=[HOST], blocks=BLOCKS, xts_key=os.urandom(64)) as t,
        NvmeTcpController.connect("127.0.0.1", t.port, NQN, HOST, io_queues=1, queue_depth=32) as c,
    ):
        c.write(1, 0, b"".join(_stamp(lba) for lba in range(BLOCKS)))
        rounds = 40  # 40 x 256 reads: the old code failed in the first few rounds
        for r in range(rounds):
            lbas = [(r * 131 + i * 37) % BLOCKS for i in range(256)]
            bufs = [bytearray(BS) for _ in lbas]
            reqs = [
                Request(
                    lambda cid, lba=lba: cmds.read(cid=cid, nsid=1, slba=lba, nlb=1),
                    what=f"Read {lba}",
                    data_in=memoryview(b),
                )
                for lba, b in zip(lbas, bufs, strict=True)
            ]
            c._io[0].execute(reqs)  # one queue, up to 32 in flight, as bdevperf
            assert all(r.cqe is not None and r.cqe.ok for r in reqs)
            bad = [lba for lba, b in zip(lbas, bufs, strict=True) if b != _stamp(lba)]
            assert not bad, f"round {r}: reads of LBAs {bad[:8]} carried other bytes"


def test_command_id_of_an_abandoned_aer_may_be_reused_on_detach() -> None:
    """Finding 2: SPDK completes its outstanding AERs locally on detach and reuses their command
    ids for the shutdown Property Get/Set; the target answered `command id N already
    outstanding` with a C2HTermReq. SPDK's own target accepts it: so must ours."""
    with (
        TargetProcess(NQN, allow_hosts=[HOST], blocks=BLOCKS) as t,
        NvmeTcpController.connect("127.0.0.1", t.port, NQN, HOST, io_queues=1) as c,
    ):
        admin = c._admin
        with admin.lock:  # submit AERs the way SPDK does: held by the target, no completion
            aer = Request(lambda cid: cmds.async_event_request(cid=cid), what="AER")
            parts = admin._submit(aer)
            cid = next(k for k, v in admin._inflight.items() if v is aer)
            admin._send(parts)
            del admin._inflight[cid]  # abandoned locally, as SPDK's detach does
            admin._free_cids.append(cid)  # the next command reuses the AER's id
        assert c.property_get(Property.CSTS) & 0x1  # answered, no C2HTermReq
        c.keep_alive()  # the admin queue still works
        assert not admin.broken and t.alive()


def test_close_waits_for_shutdown_complete_before_hanging_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 3: the initiator set CC.SHN and closed at once; SPDK's target then busy-looped
    ~100 ms per close ("freeing ctrlr with disconnect in progress"). Linux polls CSTS.SHST
    until the controller reports the shutdown complete: a target that reports "in progress"
    twice must see the host poll three times before it hangs up."""
    polls: list[int] = []
    real_get = Controller.property_get

    def slow_shutdown(self: Controller, sqe: Sqe) -> Completion:
        done = real_get(self, sqe)
        if sqe.cdw11 == Property.CSTS and self.cc & (0x3 << 14):
            polls.append(done.cdw0)
            if len(polls) <= 2:  # SHST = 01b: shutdown processing occurring
                done = Completion(cdw0=(done.cdw0 & ~0xC) | 0x4)
        return done

    monkeypatch.setattr(Controller, "property_get", slow_shutdown)
    lt = LoopThread()
    sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: MemoryBlockDevice(64)})
    tgt = NvmeTcpTarget([sub], "127.0.0.1", 0)
    lt.run(tgt.start())
    try:
        c = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST, keep_alive=False)
        c.close()
        assert len(polls) == 3 and polls[-1] & 0xC == 0x8, polls
    finally:
        lt.run(tgt.stop())
        lt.close()


def test_close_gives_up_on_a_controller_that_never_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait for CSTS.SHST is bounded: a controller stuck "in progress" costs the host at
    most SHUTDOWN_TIMEOUT_S_MAX (shortened here), then it closes anyway."""
    real_get = Controller.property_get

    def stuck(self: Controller, sqe: Sqe) -> Completion:
        done = real_get(self, sqe)
        if sqe.cdw11 == Property.CSTS and self.cc & (0x3 << 14):
            done = Completion(cdw0=(done.cdw0 & ~0xC) | 0x4)
        return done

    monkeypatch.setattr(Controller, "property_get", stuck)
    monkeypatch.setattr(host_controller, "SHUTDOWN_TIMEOUT_S_MAX", 0.3)
    lt = LoopThread()
    sub = Subsystem(nqn=NQN, allowed_hosts={HOST}, namespaces={1: MemoryBlockDevice(64)})
    tgt = NvmeTcpTarget([sub], "127.0.0.1", 0)
    lt.run(tgt.start())
    try:
        c = NvmeTcpController.connect("127.0.0.1", tgt.port, NQN, HOST, keep_alive=False)
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < 3.0  # 0.3 s of polling plus slack for a loaded box
    finally:
        lt.run(tgt.stop())
        lt.close()
