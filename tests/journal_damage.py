"""What the journal-damage tests share: an engine of one tenant whose chunks go straight to the
NVMe tier, and a check that reads back only what was written (a wrong chunk fails the test)."""

from __future__ import annotations

from pathlib import Path

from dpu_agent.engine import Engine, EngineConfig

BS = 4096


def cfg(tmp_path: Path) -> EngineConfig:
    return EngineConfig(
        data_dir=tmp_path, dram_bytes=16 * BS, nvme_bytes=1024 * BS, tenants={"acme": 0}
    )


def chunk(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 251 + 1]) * (3 * BS)  # 3 blocks: straight to NVMe


def present(eng: Engine, ids: range) -> list[int]:
    """Ids whose chunk reads back; a chunk that reads back wrong fails the test."""
    found = []
    for i in ids:
        got = eng.get_chunk("acme", chunk(i)[0])
        assert got is None or got == chunk(i)[1], i
        if got is not None:
            found.append(i)
    return found
