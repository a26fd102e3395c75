"""WAL replay after a crash that cut the last record short, or corrupted a record."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.engine.journal import Journal, JournalError, frame, pack_delete

BS = 4096


def cfg(tmp_path: Path) -> EngineConfig:
    return EngineConfig(
        data_dir=tmp_path, dram_bytes=16 * BS, nvme_bytes=512 * BS, tenants={"acme": 0}
    )


def chunk(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 251]) * (8 * BS)  # 8 blocks: straight to NVMe


def crash_after_puts(tmp_path: Path, n: int) -> Path:
    """Commit n chunks, then abandon the engine without close() (what kill -9 leaves)."""
    eng = Engine(cfg(tmp_path))
    for i in range(n):
        eng.put_chunk("acme", *chunk(i))
    eng._commit.journal.close()  # what process death does: files stay as written, the lock goes
    segments = sorted((tmp_path / "journal").glob("wal-*.log"))
    return segments[-1]


@pytest.mark.parametrize("cut", [1, 7, 30, 60])
def test_torn_tail_keeps_every_complete_record(tmp_path: Path, cut: int) -> None:
    wal = crash_after_puts(tmp_path, 10)
    data = wal.read_bytes()
    wal.write_bytes(data[:-cut])  # the last commit record is cut short
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.torn_segments == 1
        got = [eng.get_chunk("acme", chunk(i)[0]) for i in range(10)]
        assert got[:9] == [chunk(i)[1] for i in range(9)]
        assert got[9] is None
        eng.put_chunk("acme", *chunk(50))  # the engine keeps working after a torn replay
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))  # and a second restart is clean
    try:
        assert eng.recovery_report.torn_segments == 0
        assert eng.get_chunk("acme", chunk(50)[0]) == chunk(50)[1]
        assert eng.get_chunk("acme", chunk(8)[0]) == chunk(8)[1]
    finally:
        eng.close()


def test_delete_in_wal_hides_checkpointed_record(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    for i in range(4):
        eng.put_chunk("acme", *chunk(i))
    eng.checkpoint()
    eng.delete("acme", chunk(1)[0])
    eng.put_chunk("acme", chunk(2)[0], b"new" * 5000)  # replaced after the checkpoint
    eng._commit.journal.close()  # abandon it as a crash would
    eng2 = Engine(cfg(tmp_path))
    try:
        assert eng2.recovery_report.checkpoint_records == 4
        assert eng2.get_chunk("acme", chunk(0)[0]) == chunk(0)[1]
        assert eng2.get_chunk("acme", chunk(1)[0]) is None
        assert eng2.get_chunk("acme", chunk(2)[0]) == b"new" * 5000
    finally:
        eng2.close()


def test_frames_round_trip_through_replay(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.open_segment(0)
    j.append(pack_delete(1, 5, b"k" * 16))
    j.close()
    raw = (tmp_path / "wal-0000000000.log").read_bytes()
    assert raw == frame(pack_delete(1, 5, b"k" * 16))
    rec = Journal(tmp_path).load()
    assert len(rec.wal_deletes) == 1 and rec.next_seq == 6
    assert rec.wal_deletes[0]["k0"][0] == int.from_bytes(b"k" * 8, "little")


def test_a_second_agent_on_the_same_journal_is_refused(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    try:
        with pytest.raises(JournalError, match="in use by another agent"):
            Engine(cfg(tmp_path))
    finally:
        eng.close()
    Engine(cfg(tmp_path)).close()  # free again after close()
