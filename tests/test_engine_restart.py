"""Restart behaviour: clean close keeps DRAM chunks, quarantine persists, recovered chunks are
evicted before ones used since the restart, and a recovered engine keeps working."""

from __future__ import annotations

from pathlib import Path

from dpu_agent.crypto import KeyStore
from dpu_agent.engine import DRAM, NVME, Engine, EngineConfig

BS = 4096


def cfg(tmp_path: Path, nvme_blocks: int = 128) -> EngineConfig:
    return EngineConfig(
        data_dir=tmp_path,
        dram_bytes=32 * BS,
        nvme_bytes=nvme_blocks * BS,
        eviction_policy="lru",
        tenants={"acme": 0},
    )


def chunk(i: int, blocks: int = 2) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 256]) * (blocks * BS - 50)


def test_clean_close_demotes_dram_chunks_so_they_survive(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    loc = eng.put_chunk("acme", *chunk(1))
    assert loc.nsid == DRAM + 1
    eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
        assert eng.lookup("acme", [chunk(1)[0]]).hits[0].nsid == NVME + 1
    finally:
        eng.close()


def test_quarantine_survives_restart_until_cleared(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    loc = eng.put_chunk("acme", *chunk(1, blocks=8))
    with open(tmp_path / "acme" / "nvme.img", "r+b") as f:
        f.seek(loc.lba * BS)
        f.write(b"\xff" * 16)
    assert eng.get_chunk("acme", chunk(1)[0]) is None
    eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        nvme = eng.stats("acme")["tiers"]["nvme"]
        assert nvme["quarantined_bytes"] == 8 * BS
        assert nvme["free_bytes"] == (128 - 8) * BS
        assert eng.clear_quarantine("acme") == 8
        assert eng.stats("acme")["tiers"]["nvme"]["free_bytes"] == 128 * BS
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.stats("acme")["tiers"]["nvme"]["quarantined_bytes"] == 0
    finally:
        eng.close()


def test_recovered_chunks_unused_since_restart_are_evicted_first(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path, nvme_blocks=64))
    for i in range(8):  # 8 x 8 blocks: NVMe full
        eng.put_chunk("acme", *chunk(i, blocks=8))
    eng.close()
    eng = Engine(cfg(tmp_path, nvme_blocks=64))
    try:
        assert eng.recovery_report.records == 8
        assert eng.get_chunk("acme", chunk(0)[0]) == chunk(0, 8)[1]  # used since the restart
        for i in range(100, 104):
            eng.put_chunk("acme", *chunk(i, blocks=8))  # evicts 4 recovered chunks
        present = [eng.get_chunk("acme", chunk(i)[0]) is not None for i in range(8)]
        assert present[0]  # the one used after the restart stayed
        assert sum(present) == 4
        for i in range(100, 104):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i, 8)[1]
    finally:
        eng.close()


def test_pinned_recovered_chunk_is_never_evicted(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path, nvme_blocks=32))
    for i in range(4):
        eng.put_chunk("acme", *chunk(i, blocks=8))
    eng.close()
    eng = Engine(cfg(tmp_path, nvme_blocks=32))
    try:
        eng.pin("acme", chunk(0)[0])
        for i in range(100, 110):
            eng.put_chunk("acme", *chunk(i, blocks=8))
        assert eng.get_chunk("acme", chunk(0)[0]) == chunk(0, 8)[1]
    finally:
        eng.close()


def test_key_rotation_does_not_strand_existing_nvme_chunks(tmp_path: Path) -> None:
    """The NVMe tier reopens with the key generation its chunks were written under."""
    eng = Engine(cfg(tmp_path))
    eng.put_chunk("acme", *chunk(1, blocks=8))
    eng.close()
    assert KeyStore(tmp_path / "keys.json").rotate("acme") == 2
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1, 8)[1]
        eng.put_chunk("acme", *chunk(2, blocks=8))
        eng.put_chunk("acme", *chunk(3))  # DRAM: the new key; demoted at close
        assert eng.get_chunk("acme", chunk(2)[0]) == chunk(2, 8)[1]
        assert eng.stats("acme")["integrity_failures"] == 0
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        for i, blocks in ((1, 8), (2, 8), (3, 2)):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i, blocks)[1]
    finally:
        eng.close()


def test_a_restart_begins_each_tiers_election_with_the_leader_it_had(tmp_path: Path) -> None:
    """`elect`'s leader is written beside the checkpoint and given back at the next start,
    for each tenant and tier. A damaged or
    hostile file costs the restart its leader, never the start."""
    import dataclasses
    import json

    from dpu_agent.engine.engine import POLICY_STATE

    elect = dataclasses.replace(cfg(tmp_path), eviction_policy="elect")
    eng = Engine(elect)
    assert eng.policy_state() == {
        "acme": {"dram": {"leader": "prefix-run"}, "nvme": {"leader": "prefix-run"}}
    }
    eng.put_chunk("acme", *chunk(1))
    assert eng.restore_policies({"acme": {"nvme": {"leader": "s3fifo"}}, "ghost": {}}) == 1
    eng.close()
    state = json.loads((elect.journal_path / POLICY_STATE).read_text())
    assert state["acme"]["nvme"] == {"leader": "s3fifo"}
    eng = Engine(elect)
    try:
        assert eng.policy_state()["acme"] == {
            "dram": {"leader": "prefix-run"}, "nvme": {"leader": "s3fifo"},
        }  # fmt: skip
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
    finally:
        eng.close()
    for damaged in (
        b"{not json",
        b"[1, 2]",
        b'{"acme": {"nvme": {"leader": 7}}}',
        b"x" * (2 << 20),
    ):
        (elect.journal_path / POLICY_STATE).write_bytes(damaged)
        eng = Engine(elect)
        try:
            assert eng.policy_state()["acme"]["nvme"] == {"leader": "prefix-run"}
        finally:
            eng.close()


def test_the_policy_state_is_rewritten_only_when_a_leader_changed(tmp_path: Path) -> None:
    """A checkpoint comes often and the file costs two fsyncs: it is replaced only when what it
    holds changed."""
    import dataclasses
    import json

    from dpu_agent.engine.engine import POLICY_STATE

    elect = dataclasses.replace(cfg(tmp_path), eviction_policy="elect")
    eng = Engine(elect)
    try:
        path = elect.journal_path / POLICY_STATE
        eng.checkpoint()
        first = path.stat().st_ino
        eng.checkpoint()
        assert path.stat().st_ino == first  # unchanged: not replaced
        eng.restore_policies({"acme": {"nvme": {"leader": "s3fifo"}}})
        eng.checkpoint()
        assert path.stat().st_ino != first
        assert json.loads(path.read_text())["acme"]["nvme"] == {"leader": "s3fifo"}
    finally:
        eng.close()
