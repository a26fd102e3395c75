"""Full + incremental backup, restored into a fresh agent that has the same key file."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from dpu_agent.engine import ChecksumMismatch, Engine, EngineConfig, EngineError

BS = 4096


def cfg(data_dir: Path, key_file: Path | None = None) -> EngineConfig:
    return EngineConfig(
        data_dir=data_dir,
        dram_bytes=16 * BS,
        nvme_bytes=512 * BS,
        key_file=key_file,
        tenants={"acme": 0, "bravo": 0},
    )


def chunk(i: int, blocks: int = 8) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 256, 7]) * (blocks * BS // 2 - 5)


def test_full_plus_incremental_restore_serves_the_same_chunks(tmp_path: Path) -> None:
    src = Engine(cfg(tmp_path / "a"))
    try:
        for i in range(10):
            src.put_chunk("acme", *chunk(i))
            src.put_chunk("bravo", *chunk(100 + i))
        full = src.backup(tmp_path / "b1")
        assert full["kind"] == "full" and full["records"] == 20
        src.delete("acme", chunk(3)[0])
        src.put_chunk("acme", chunk(4)[0], b"replaced" * 3000)
        src.put_chunk("acme", *chunk(20))
        src.put_chunk("acme", chunk(40, blocks=1)[0], b"dram only")  # small: DRAM
        inc = src.backup(tmp_path / "b2", incremental=True)
        assert inc["kind"] == "incremental" and inc["prev_seq"] == full["seq"]
        # the DRAM chunk is moved to NVMe first, so the backup holds it too
        assert inc["records"] == 3 and inc["deleted"] == 1
        assert inc["dram_persisted"] == 1 and inc["dram_only_chunks"] == 0
        expected = {("acme", chunk(i)[0]): chunk(i)[1] for i in (0, 1, 2, 5, 6, 7, 8, 9, 20)}
        expected[("acme", chunk(4)[0])] = b"replaced" * 3000
        expected[("acme", chunk(40)[0])] = b"dram only"
        expected.update({("bravo", chunk(100 + i)[0]): chunk(100 + i)[1] for i in range(10)})
    finally:
        src.close()
    dst = Engine(cfg(tmp_path / "c", key_file=tmp_path / "a" / "keys.json"))
    try:
        out = dst.restore([tmp_path / "b1", tmp_path / "b2"])
        assert out["backups"] == 2
        for (tenant, key), data in expected.items():
            assert dst.get_chunk(tenant, key) == data
        assert dst.get_chunk("acme", chunk(3)[0]) is None
        assert dst.stats()["records"] == len(expected)
    finally:
        dst.close()
    again = Engine(cfg(tmp_path / "c", key_file=tmp_path / "a" / "keys.json"))
    try:  # the restore is durable: journaled and checkpointed
        assert all(again.get_chunk(t, k) == d for (t, k), d in expected.items())
    finally:
        again.close()


def test_restore_with_another_key_file_is_a_checksum_mismatch(tmp_path: Path) -> None:
    src = Engine(cfg(tmp_path / "a"))
    src.put_chunk("acme", *chunk(1))
    src.backup(tmp_path / "b1")
    src.close()
    dst = Engine(cfg(tmp_path / "c"))  # its own, different keys
    try:
        with pytest.raises(ChecksumMismatch, match="key file"):
            dst.restore([tmp_path / "b1"])
        assert dst.get_chunk("acme", chunk(1)[0]) is None
    finally:
        dst.close()


def test_backup_chain_errors(tmp_path: Path) -> None:
    src = Engine(cfg(tmp_path / "a"))
    try:
        with pytest.raises(EngineError, match="full backup first"):
            src.backup(tmp_path / "x", incremental=True)
        src.put_chunk("acme", *chunk(1))
        src.backup(tmp_path / "b1")
        with pytest.raises(EngineError, match="already holds a backup"):
            src.backup(tmp_path / "b1")
        src.backup(tmp_path / "b2", incremental=True)
        src.put_chunk("acme", *chunk(2))
        src.backup(tmp_path / "b3", incremental=True)
    finally:
        src.close()
    dst = Engine(cfg(tmp_path / "c", key_file=tmp_path / "a" / "keys.json"))
    try:
        with pytest.raises(EngineError, match="restore starts from a full"):
            dst.restore([tmp_path / "b2"])
        with pytest.raises(EngineError, match="does not follow"):
            dst.restore([tmp_path / "b1", tmp_path / "b3"])
        shutil.rmtree(tmp_path / "b3")
        with pytest.raises(EngineError, match=r"no manifest\.json"):
            dst.restore([tmp_path / "b1", tmp_path / "b3"])
    finally:
        dst.close()


def test_a_backup_goes_only_to_a_new_or_empty_directory_not_the_agents_own(
    tmp_path: Path,
) -> None:
    """`dpuctl backup create DIR` wrote into any existing directory (a user's data.bin
    replaced by the backup's) and made it 0700 (a shared 1777 /tmp too), and accepted the
    agent's own data, journal and NVMe directories."""
    src = Engine(cfg(tmp_path / "a"))
    try:
        src.put_chunk("acme", *chunk(1))
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o1777)
        os.chmod(mine, 0o1777)
        (mine / "data.bin").write_text("mine")
        with pytest.raises(EngineError, match="is not empty"):
            src.backup(mine)
        assert (mine / "data.bin").read_text() == "mine"
        assert stat.S_IMODE(mine.stat().st_mode) == 0o1777
        (tmp_path / "file").write_text("x")
        with pytest.raises(EngineError, match="is not a directory"):
            src.backup(tmp_path / "file")
        for own in ("a/journal/b", "a/acme/b"):  # the NVMe file of acme is a/acme/nvme.img
            with pytest.raises(EngineError, match="inside the agent's own"):
                src.backup(tmp_path / own)
        with pytest.raises(EngineError, match=r"not empty|the agent's data directory"):
            src.backup(tmp_path / "a")
        (tmp_path / "empty").mkdir()
        assert src.backup(tmp_path / "empty")["records"] >= 1  # empty: fine
    finally:
        src.close()


def test_incremental_backup_holds_the_first_commit_after_the_full_one(tmp_path: Path) -> None:
    """Regression: the manifest's seq is the next sequence number, so `>` skipped one record."""
    src = Engine(cfg(tmp_path / "a"))
    try:
        src.put_chunk("acme", *chunk(1))
        src.backup(tmp_path / "b1")
        src.put_chunk("acme", *chunk(2))  # the very next sequence number after the backup
        inc = src.backup(tmp_path / "b2", incremental=True)
        assert inc["records"] == 1
    finally:
        src.close()
    dst = Engine(cfg(tmp_path / "c", key_file=tmp_path / "a" / "keys.json"))
    try:
        dst.restore([tmp_path / "b1", tmp_path / "b2"])
        assert dst.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
        assert dst.get_chunk("acme", chunk(2)[0]) == chunk(2)[1]
    finally:
        dst.close()
