"""Issue 10, findings 3 and 4: damage to the journal costs only what is damaged.

A flipped bit in the middle of a WAL segment used to end the replay of that segment (every
later record lost, and the next checkpoint made it permanent); a flipped bit in checkpoint.bin
stopped the agent from starting. Now a bad frame is skipped and counted, the previous
checkpoint generation is used when the newest fails its checksum, and without any good one the
index is rebuilt from the WAL that is left: the engine always starts with what verifies.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from journal_damage import BS, cfg, chunk, present

from dpu_agent.engine import Engine
from dpu_agent.engine.journal import FRAME_BYTES


def test_flipped_bit_mid_segment_loses_only_that_frame(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    for i in range(120):
        eng.put_chunk("acme", *chunk(i))
    eng._commit.journal.close()  # kill -9: files as written, no checkpoint
    wal = sorted((tmp_path / "journal").glob("wal-*.log"))[-1]
    data = bytearray(wal.read_bytes())
    frames = len(data) // FRAME_BYTES
    data[(frames // 2) * FRAME_BYTES + 40] ^= 0x10  # one bit inside the middle frame's body
    wal.write_bytes(bytes(data))
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.damaged_frames == 1
        assert eng.stats()["recovery"]["damaged_frames"] == 1
        assert len(present(eng, range(120))) >= 119  # only the damaged frame's chunk may go
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))  # the checkpoint taken after the damage keeps the rest
    try:
        assert eng.recovery_report.damaged_frames == 0
        assert len(present(eng, range(120))) >= 119
    finally:
        eng.close()


def put_and_close(tmp_path: Path, ids: range) -> None:
    eng = Engine(cfg(tmp_path))
    for i in ids:
        eng.put_chunk("acme", *chunk(i))
    eng.close()  # checkpoints


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bit_in_checkpoint_uses_the_previous_generation(tmp_path: Path) -> None:
    put_and_close(tmp_path, range(0, 20))
    put_and_close(tmp_path, range(20, 40))
    journal = tmp_path / "journal"
    assert (journal / "checkpoint.prev.bin").exists()
    flip(journal / "checkpoint.bin")
    eng = Engine(cfg(tmp_path))  # used to refuse to start
    try:
        r = eng.recovery_report
        assert (r.checkpoint_used, r.checkpoints_damaged) == ("previous", 1)
        assert present(eng, range(40)) == list(range(40))  # previous + WAL after it: all
        assert (journal / "checkpoint.bin.damaged").exists()  # kept for the operator
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.checkpoint_used == "current"
        assert present(eng, range(40)) == list(range(40))
    finally:
        eng.close()


def test_both_checkpoints_damaged_rebuilds_from_the_wal_and_starts(tmp_path: Path) -> None:
    put_and_close(tmp_path, range(0, 10))
    put_and_close(tmp_path, range(10, 20))
    journal = tmp_path / "journal"
    flip(journal / "checkpoint.bin")
    flip(journal / "checkpoint.prev.bin")
    eng = Engine(cfg(tmp_path))
    try:
        r = eng.recovery_report
        assert (r.checkpoint_used, r.checkpoints_damaged) == ("none", 2)
        # the WAL kept since the previous checkpoint names the tenant and holds the last puts
        assert set(range(10, 20)) <= set(present(eng, range(20)))
        eng.put_chunk("acme", *chunk(99))  # and it serves on
    finally:
        eng.close()


def test_checkpoints_wal_and_backups_are_private_files(tmp_path: Path) -> None:
    """Finding 7: checkpoint.bin and backups were written 0644."""
    put_and_close(tmp_path, range(0, 5))
    eng = Engine(cfg(tmp_path))
    try:
        eng.put_chunk("acme", *chunk(7))
        eng.checkpoint()
        eng.backup(tmp_path / "bk")
    finally:
        eng.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "LOCK"]
    names = {p.name for p in files}
    assert {"checkpoint.bin", "checkpoint.prev.bin", "nvme.img", "keys.json"} <= names
    assert any(p.parent.name == "bk" for p in files)
    loose = [f"{p.relative_to(tmp_path)} {stat.filemode(p.stat().st_mode)}" for p in files
             if p.stat().st_mode & 0o077]  # fmt: skip
    assert loose == []
    assert os.stat(tmp_path / "bk").st_mode & 0o077 == 0


def test_failed_demotion_write_gives_the_nvme_extent_back(tmp_path: Path) -> None:
    """Finding 7: _demote leaked the NVMe extent when the write raised."""
    from dpu_agent.blockdev import BlockDeviceError
    from dpu_agent.engine import DRAM, NVME

    eng = Engine(cfg(tmp_path))
    try:
        key = b"d" * 16
        loc = eng.put_chunk("acme", key, b"x" * (2 * BS))  # 2 blocks: DRAM
        assert loc.nsid == DRAM + 1
        ts = eng._tenants["acme"]
        nvme = ts.tiers[NVME]
        free_before = nvme.alloc.free_blocks

        tried: list[int] = []

        def broken_write(lba: int, data: object) -> None:
            tried.append(lba)
            raise BlockDeviceError("injected write failure")

        nvme.devices.device.write = broken_write  # type: ignore[method-assign]
        with eng._lock:
            row = eng._index.find(ts.tenant_id, key)
            with pytest.raises(BlockDeviceError, match="injected write failure"):
                eng._mover.demote(ts, row, eng._clock(), evict=False)
        assert tried, "the demotion never reached the NVMe write: nothing was tested"
        assert nvme.alloc.free_blocks == free_before  # nothing leaked
        del nvme.devices.device.write
        assert eng.get_chunk("acme", key) == b"x" * (2 * BS)  # still served from DRAM
    finally:
        eng.close()


def test_a_lost_wal_segment_is_a_loss_not_a_clean_recovery(tmp_path: Path) -> None:
    """The segment the checkpoint names deleted after a crash: its acknowledged puts were gone
    and recovery said damaged_frames 0, nothing lost. Now the start counts it missing (the
    report, `engine.recovered_with_losses`), and what the checkpoint holds is served."""
    put_and_close(tmp_path, range(20))  # checkpointed
    eng = Engine(cfg(tmp_path))
    for i in range(20, 50):
        eng.put_chunk("acme", *chunk(i))  # in the WAL only
    eng._commit.journal.close()  # kill -9
    named = eng._commit.journal.checkpoint_segment
    (tmp_path / "journal" / f"wal-{named:010d}.log").unlink()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.missing_segments == 1
        assert eng.stats()["recovery"]["missing_segments"] == 1
        assert present(eng, range(20)) == list(range(20))
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))  # the checkpoint taken after the loss: a clean start again
    try:
        assert eng.recovery_report.missing_segments == 0
        assert present(eng, range(20)) == list(range(20))
    finally:
        eng.close()


def test_a_gap_in_the_segments_is_a_loss(tmp_path: Path) -> None:
    """Rebuilt from the WAL alone (no checkpoint verifies): a segment missing between two
    that remain is counted."""
    eng = Engine(cfg(tmp_path))
    for i in range(10):
        eng.put_chunk("acme", *chunk(i))
    eng._commit.journal.close()
    journal = tmp_path / "journal"
    for name in ("checkpoint.bin", "checkpoint.prev.bin"):
        (journal / name).unlink(missing_ok=True)
    last = int(sorted(journal.glob("wal-*.log"))[-1].name[4:14])
    (journal / f"wal-{last + 2:010d}.log").write_bytes(b"")  # a later start's segment ...
    # ... and the one between them lost
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.missing_segments == 1
    finally:
        eng.close()


def test_a_first_start_misses_no_segment(tmp_path: Path) -> None:
    """A new data directory has no segment and no checkpoint: nothing is missing (the first
    version of the check counted segment 0 lost on every first start)."""
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.missing_segments == 0
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.recovery_report.missing_segments == 0
    finally:
        eng.close()
