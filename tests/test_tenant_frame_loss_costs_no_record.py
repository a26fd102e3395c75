"""Losing the WAL frame that names a tenant used to cost every record of that tenant.

A record names its tenant by id; the id's name was in a WAL frame (one per segment) and in the
checkpoint. One flipped bit in that frame, or the live segment truncated to 0 underneath a
running agent, and recovery dropped every record of the tenant: 0 of 100 acknowledged chunks
came back after kill -9. Now the id's name is also in tenant-ids.json, a truncated or deleted
live segment is noticed at the next tick and rewritten from memory (a checkpoint) with writes
fenced until it lands, and what a kill before that tick can cost is exactly the frames that
were in the lost bytes.

Each kill -9 is the engine dropped without close(): the journal's descriptor closed (the kernel
does that for a killed process), files as written, no checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from journal_damage import cfg, chunk, present

from dpu_agent.engine import Engine
from dpu_agent.engine.errors import JournalUnavailable
from dpu_agent.engine.journal import FRAME_BYTES, OP_TENANT

CHUNKS = 100


def kill9(eng: Engine) -> None:
    eng._commit.journal.close()


def live_segment(tmp_path: Path) -> Path:
    return sorted((tmp_path / "journal").glob("wal-*.log"))[-1]


def test_flipped_bit_in_the_tenant_frame_loses_no_acknowledged_chunk(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    for i in range(CHUNKS):
        eng.put_chunk("acme", *chunk(i))
    kill9(eng)
    wal = live_segment(tmp_path)
    data = bytearray(wal.read_bytes())
    bodies = [data[f * FRAME_BYTES + 8] for f in range(len(data) // FRAME_BYTES)]
    tenant_frames = [f for f, op in enumerate(bodies) if op == OP_TENANT]
    assert tenant_frames  # the segment names the tenant in a frame of its own
    for f in tenant_frames:  # every frame naming the tenant: one flipped bit in its name
        data[f * FRAME_BYTES + 8 + 11] ^= 0x04
    wal.write_bytes(bytes(data))
    eng = Engine(cfg(tmp_path))
    try:
        r = eng.recovery_report
        # lost bytes: the tenant frames (93 bytes each, a name and no chunk); chunks lost: none
        assert r.damaged_frames == len(tenant_frames)
        assert r.dropped_records == 0
        assert present(eng, range(CHUNKS)) == list(range(CHUNKS))  # used to be 0 of 100
    finally:
        eng.close()


def test_wal_truncated_under_a_running_engine_is_rewritten_at_the_next_tick(
    tmp_path: Path,
) -> None:
    eng = Engine(cfg(tmp_path))
    for i in range(CHUNKS):
        eng.put_chunk("acme", *chunk(i))
    os.truncate(live_segment(tmp_path), 0)  # an operator's mistake, a broken tool
    with pytest.raises(JournalUnavailable, match="truncated"):
        eng.put_chunk("acme", *chunk(CHUNKS))  # not acknowledged: its journal is gone
    eng.tick()  # checkpoints from memory, lifts the fence
    assert eng.stats()["journal_fenced"] == ""
    for i in range(CHUNKS, CHUNKS + 20):  # and writes go on
        eng.put_chunk("acme", *chunk(i))
    kill9(eng)
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.dropped_records == 0
        # lost: 0 bytes of any acknowledged chunk (all 120 back; it used to be 0 of 100)
        assert present(eng, range(CHUNKS + 20)) == list(range(CHUNKS + 20))
    finally:
        eng.close()


def test_deleted_live_segment_fences_writes_until_the_rewrite_lands(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    try:
        for i in range(10):
            eng.put_chunk("acme", *chunk(i))
        live_segment(tmp_path).unlink()
        with eng._lock:
            assert eng._commit.check_lost()  # what tick() checks first
        with pytest.raises(JournalUnavailable, match="deleted"):
            eng.put_chunk("acme", *chunk(10))  # not acknowledged: its journal is gone
        eng._rewrite_journal()
        eng.put_chunk("acme", *chunk(10))
    finally:
        kill9(eng)
    eng = Engine(cfg(tmp_path))
    try:
        assert present(eng, range(11)) == list(range(11))
    finally:
        eng.close()


def test_wal_truncated_then_killed_before_a_tick_acknowledges_nothing_more(
    tmp_path: Path,
) -> None:
    eng = Engine(cfg(tmp_path))
    for i in range(CHUNKS):
        eng.put_chunk("acme", *chunk(i))
    wal = live_segment(tmp_path)
    lost_bytes = wal.stat().st_size
    os.truncate(wal, 0)
    for i in range(CHUNKS, CHUNKS + 5):  # each refused before anything is written
        with pytest.raises(JournalUnavailable, match="truncated"):
            eng.put_chunk("acme", *chunk(i))
    kill9(eng)  # before any tick could rewrite the journal
    eng = Engine(cfg(tmp_path))
    try:
        # the lost bytes: the tenant frame and the commit frames of chunks 0-99 (93 bytes
        # each), so those chunks are gone; nothing acknowledged after the truncation (the old
        # agent acknowledged on, and lost that too)
        assert lost_bytes == (CHUNKS + 1) * FRAME_BYTES
        assert present(eng, range(CHUNKS + 5)) == []
        assert eng.recovery_report.dropped_records == 0
    finally:
        eng.close()


def test_zeroed_wal_bytes_cost_exactly_the_frames_in_them(tmp_path: Path) -> None:
    """What a truncation racing an append leaves (frames are written at their own offset): a
    hole of zeros before later frames. The frames in the hole are lost, nothing else."""
    eng = Engine(cfg(tmp_path))
    for i in range(CHUNKS):
        eng.put_chunk("acme", *chunk(i))
    kill9(eng)
    wal = live_segment(tmp_path)
    data = bytearray(wal.read_bytes())
    hole = 51 * FRAME_BYTES  # the tenant frame and the commits of chunks 0-49
    data[:hole] = bytes(hole)
    wal.write_bytes(bytes(data))
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.damaged_frames == 51
        assert present(eng, range(CHUNKS)) == list(range(50, CHUNKS))  # used to be []
    finally:
        eng.close()


def test_agent_notices_its_wal_truncated_and_loses_nothing_acknowledged_at_kill9(
    tmp_path: Path,
) -> None:
    """The finding as it was seen: a running agent's live WAL truncated to 0, the agent kept
    acknowledging, kill -9, restart: 0 of 100 came back. Now its tick (0.5 s) rewrites it."""
    import time

    import numpy as np
    from test_service import LAYOUT, SALT, chunks_for, tokens_for

    from dpu_agent.testing import spawn_agent
    from host_shim import KVClient
    from host_shim.client import ControlChannel
    from kvproto.control import ADMIN_TENANT

    env = {"DPUKV_STORAGE_DRAM_BYTES": str(16 << 10)}  # every chunk on NVMe
    puts = 50  # of 2 chunks: 100 chunks, as in the finding
    a = spawn_agent(tmp_path / "var", env=env)
    try:
        with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token, timeout_s=10) as admin:
            admin.connect()
            segment = admin.call("stats")["stats"]["journal_segment"]
            with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
                for s in range(puts):
                    assert c.put(tokens_for(s, 2), chunks_for(s, 2)) == 2
                wal = tmp_path / "var" / "journal" / f"wal-{segment:010d}.log"
                os.truncate(wal, 0)
                deadline = time.monotonic() + 30  # a tick is 0.5 s; a loaded box
                while True:  # rewritten: a new segment, and the fence of the rewrite lifted
                    st = admin.call("stats")["stats"]
                    if st["journal_segment"] != segment and not st["journal_fenced"]:
                        break
                    assert time.monotonic() < deadline, "the truncated WAL was never rewritten"
                    time.sleep(0.1)
                for s in range(puts, puts + 10):  # acknowledged after the rewrite
                    assert c.put(tokens_for(s, 2), chunks_for(s, 2)) == 2
    finally:
        a.kill()
    a = spawn_agent(tmp_path / "var", env=env)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            lost = []
            for s in range(puts + 10):
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
                got = c.get(tokens_for(s, 2), out)
                want = chunks_for(s, 2)
                same = all(o.tobytes() == w.tobytes() for o, w in zip(out, want, strict=True))
                if got != 2 or not same:
                    lost.append(s)
        # bytes lost: none of the 120 acknowledged chunks (16 KiB each); it used to be all
        assert lost == [], f"{len(lost)} of {puts + 10} acknowledged puts lost"
    finally:
        a.stop()
