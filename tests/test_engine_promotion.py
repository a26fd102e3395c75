"""Promotion NVMe -> DRAM: a chunk that turns hot on NVMe moves back to DRAM in tick(), keeping
leases (a reader of the old NVMe extent keeps reading it) and integrity (a corrupt copy is never
promoted), and demotion takes it back down when it cools."""

from __future__ import annotations

import os
from pathlib import Path

from dpu_agent.engine import DRAM, NVME, Engine, EngineConfig
from dpu_agent.eviction import DEFAULT_POLICY

BS = 4096


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tmp_path: Path, clock: FakeClock, policy: str = DEFAULT_POLICY) -> Engine:
    cfg = EngineConfig(
        data_dir=tmp_path,
        eviction_policy=policy,
        dram_bytes=32 * BS,
        nvme_bytes=128 * BS,
        tenants={"acme": 0},
        lease_ttl_s=5.0,
        reservation_ttl_s=5.0,
    )
    return Engine(cfg, clock=clock)


def chunk(i: int, size: int = 2 * BS - 100) -> tuple[bytes, bytes]:
    key = i.to_bytes(16, "little")
    return key, (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def nsid_of(eng: Engine, key: bytes) -> int:
    res = eng.lookup("acme", [key], lease=False)
    return res.hits[0].nsid


def fill_and_demote(eng: Engine, clock: FakeClock, count: int = 24) -> list[tuple[bytes, bytes]]:
    """`count` chunks of 2 blocks into a 32-block DRAM: the oldest end up on NVMe."""
    chunks = [chunk(i) for i in range(count)]
    for key, data in chunks:
        clock.t += 1.0
        eng.put_chunk("acme", key, data)
    eng.tick()  # background demotion frees DRAM's 10% target
    return chunks


def test_chunk_read_repeatedly_from_nvme_is_promoted_and_served_from_dram(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    eng = make(tmp_path, clock)
    try:
        chunks = fill_and_demote(eng, clock)
        key, data = chunks[0]
        assert nsid_of(eng, key) == NVME + 1
        cold_key = chunks[1][0]
        assert nsid_of(eng, cold_key) == NVME + 1
        assert eng.tick()["promoted"] == 0  # nothing read twice since the last scan
        for _ in range(3):
            clock.t += 1.0
            assert eng.get_chunk("acme", key) == data  # served from NVMe, turning hot
        assert eng.tick()["promoted"] == 1
        loc = eng.lookup("acme", [key])
        assert loc.hits[0].nsid == DRAM + 1  # now served from DRAM
        assert loc.lease_id is not None
        eng.release("acme", loc.lease_id)
        assert eng.get_chunk("acme", key) == data
        assert nsid_of(eng, cold_key) == NVME + 1  # a chunk read once stays where it is
        st = eng.stats("acme")
        assert st["promotions"] == 1 and eng.stats()["promotions"] == 1
        for k, d in chunks:
            assert eng.get_chunk("acme", k) == d
    finally:
        eng.close()


def test_reads_too_far_apart_do_not_promote(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = make(tmp_path, clock)
    try:
        key, data = fill_and_demote(eng, clock)[0]
        assert eng.get_chunk("acme", key) == data
        clock.t += 3600.0  # an hour later: not hot
        assert eng.get_chunk("acme", key) == data
        assert eng.tick()["promoted"] == 0
        assert nsid_of(eng, key) == NVME + 1
    finally:
        eng.close()


def test_promotion_keeps_a_readers_lease_on_the_nvme_extent(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = make(tmp_path, clock)
    try:
        key, data = fill_and_demote(eng, clock)[0]
        eng.get_chunk("acme", key)
        held = eng.lookup("acme", [key])  # a reader leases the NVMe extent, then the promotion
        old = held.hits[0]
        assert old.nsid == NVME + 1 and held.lease_id is not None
        nvme_free = eng.stats("acme")["tiers"]["nvme"]["free_bytes"]
        assert eng.tick()["promoted"] == 1
        assert nsid_of(eng, key) == DRAM + 1
        # the old extent is not freed while leased: NVMe free space did not grow by it
        assert eng.stats("acme")["tiers"]["nvme"]["free_bytes"] == nvme_free
        for i in range(100, 180):  # pressure that fills NVMe and reuses every free extent
            clock.t += 0.01  # within the lease's TTL
            eng.put_chunk("acme", *chunk(i))
            eng.tick()
        buf = bytearray(old.block_count * BS)
        eng.namespaces("acme")[old.nsid].read_into(old.lba, memoryview(buf))
        assert bytes(buf[: old.length]) == data  # the leased extent was never reused
        eng.release("acme", held.lease_id)
        st = eng.stats("acme")
        assert st["leases"] == 0
        # the row's lease count went back to zero: the chunk can be demoted and evicted again
        for i in range(200, 300):
            clock.t += 1.0
            eng.put_chunk("acme", *chunk(i))
            eng.tick()
        assert eng.get_chunk("acme", key) in (None, data)
        assert eng.stats("acme")["records"] <= 80
    finally:
        eng.close()


def test_promoted_chunk_is_demoted_again_when_it_cools_and_reads_back(tmp_path: Path) -> None:
    clock = FakeClock()
    # LRU: cooling is recency alone. A frequency-aware policy rightly keeps a chunk that came
    # back to DRAM (its history survives the demotion) ahead of one-time writes.
    eng = make(tmp_path, clock, "lru")
    try:
        chunks = fill_and_demote(eng, clock)
        key, data = chunks[0]
        eng.get_chunk("acme", key)
        eng.get_chunk("acme", key)
        assert eng.tick()["promoted"] == 1
        for i in range(24, 40):  # new writes push DRAM's coldest, the promoted chunk, down
            clock.t += 1.0
            eng.put_chunk("acme", *chunk(i))
            eng.tick()
        assert nsid_of(eng, key) == NVME + 1
        assert eng.get_chunk("acme", key) == data
        assert eng.stats("acme")["integrity_failures"] == 0
    finally:
        eng.close()


def test_corrupt_nvme_chunk_is_quarantined_not_promoted(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = make(tmp_path, clock)
    try:
        key, _ = fill_and_demote(eng, clock)[0]
        loc = eng.lookup("acme", [key], lease=False).hits[0]
        assert loc.nsid == NVME + 1
        eng.lookup("acme", [key], lease=False)  # read twice: hot
        with eng.locked() as state:
            raw = state.tenant("acme").tiers[NVME].devices.raw  # the file under the cipher
        raw.write(loc.lba, os.urandom(BS))
        assert eng.tick()["promoted"] == 0
        st = eng.stats("acme")
        assert st["integrity_failures"] == 1 and st["promotions"] == 0
        assert eng.get_chunk("acme", key) is None
    finally:
        eng.close()


def test_promoted_chunk_survives_a_clean_restart(tmp_path: Path) -> None:
    """DRAM is volatile: the journal drops the NVMe record on promotion, close() demotes the
    chunk back, and the restarted engine serves it."""
    clock = FakeClock()
    eng = make(tmp_path, clock)
    chunks = fill_and_demote(eng, clock)
    key, data = chunks[0]
    eng.get_chunk("acme", key)
    eng.get_chunk("acme", key)
    assert eng.tick()["promoted"] == 1
    eng.close()
    eng = make(tmp_path, clock)
    try:
        assert eng.get_chunk("acme", key) == data
        assert eng.stats("acme")["integrity_failures"] == 0
    finally:
        eng.close()


def test_promoted_chunk_is_not_resurrected_on_reused_nvme_blocks_after_a_crash(
    tmp_path: Path,
) -> None:
    """The move journals a delete of the NVMe record: after kill -9 the (volatile) promoted
    chunk is a miss, never a record pointing at NVMe blocks that were freed by the move and
    overwritten since (here by a write whose commit the crash prevented)."""
    clock = FakeClock()
    eng = make(tmp_path, clock)
    chunks = fill_and_demote(eng, clock)
    key, _ = chunks[0]
    old = eng.lookup("acme", [key], lease=False).hits[0]
    assert old.nsid == NVME + 1
    eng.get_chunk("acme", key)
    assert eng.tick()["promoted"] == 1
    eng.namespaces("acme")[old.nsid].write(old.lba, memoryview(os.urandom(old.block_count * BS)))
    eng._sync()
    eng._commit.journal.close()  # what process death does: files stay as written, the lock goes
    eng = make(tmp_path, clock)
    try:
        assert eng.get_chunk("acme", key) is None  # lost with DRAM, as any DRAM chunk
        assert eng.stats("acme")["integrity_failures"] == 0  # no stale record was recovered
        for k, d in chunks[1:]:
            assert eng.get_chunk("acme", k) in (None, d)  # DRAM ones lost, NVMe ones intact
    finally:
        eng.close()
