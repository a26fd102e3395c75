"""Engine behaviour with real devices (DRAM mmap + file under AES-XTS): reads, two-phase writes,
leases, placement, demotion, eviction, quotas, integrity, isolation, and every error class."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.blockdev import MemoryBlockDevice
from dpu_agent.engine import (
    DRAM,
    NVME,
    Engine,
    EngineConfig,
    LeaseExpired,
    LimitExceeded,
    QuotaExceeded,
    ReservationExpired,
    TierDevices,
    TierFull,
    TierSpec,
    UnknownKey,
    UnknownTenant,
)
from dpu_agent.metrics import sample_value
from kvproto.checksum import chunk_checksum

BS = 4096


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tmp_path: Path, clock: FakeClock | None = None, **kw: object) -> Engine:
    opts: dict[str, object] = {
        "dram_bytes": 32 * BS,
        "nvme_bytes": 128 * BS,
        "tenants": {"acme": 0},
    }
    opts.update(kw)
    cfg = EngineConfig(data_dir=tmp_path, lease_ttl_s=5.0, reservation_ttl_s=5.0, **opts)  # type: ignore[arg-type]
    return Engine(cfg, clock=clock or FakeClock())


def chunk(i: int, size: int = 2 * BS - 100) -> tuple[bytes, bytes]:
    key = i.to_bytes(16, "little")
    return key, (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def eng(tmp_path: Path, clock: FakeClock) -> Iterator[Engine]:
    e = make(tmp_path, clock)
    yield e
    e.close()


def test_put_get_and_longest_prefix_lookup(eng: Engine) -> None:
    chunks = [chunk(i) for i in range(5)]
    parent = None
    for key, data in chunks:
        eng.put_chunk("acme", key, data, parent=parent)
        parent = key
    for key, data in chunks:
        assert eng.get_chunk("acme", key) == data
    keys = [k for k, _ in chunks]
    res = eng.lookup("acme", [*keys[:3], chunk(99)[0], keys[4]])
    assert [h.key for h in res.hits] == keys[:3]  # stops at the first miss
    assert res.lease_id is not None and res.lease_expires_s == 5.0
    for h, (_, d) in zip(res.hits, chunks[:3], strict=True):
        assert h.checksum == chunk_checksum(h.key, d)
    eng.release("acme", res.lease_id)
    miss = eng.lookup("acme", [chunk(99)[0]])
    assert miss.hits == [] and miss.lease_id is None
    assert eng.get_chunk("acme", chunk(98)[0]) is None


def test_two_phase_write_through_the_exported_namespace(eng: Engine) -> None:
    key, data = chunk(1)
    res = eng.reserve("acme", key, len(data))
    dev = eng.namespaces("acme")[res.nsid]
    padded = data + bytes(res.block_count * BS - len(data))
    dev.write(res.lba, padded)
    assert eng.lookup("acme", [key]).hits == []  # not visible before commit
    loc = eng.commit("acme", res.reservation_id, chunk_checksum(key, data))
    assert (loc.nsid, loc.lba, loc.length) == (res.nsid, res.lba, len(data))
    assert eng.get_chunk("acme", key) == data


def test_nvme_backing_file_holds_only_ciphertext(tmp_path: Path, eng: Engine) -> None:
    key = b"k" * 16
    data = b"PLAINTEXT-MARKER" * (8 * BS // 16)  # 8 blocks > DRAM/8: placed on NVMe
    loc = eng.put_chunk("acme", key, data)
    assert loc.nsid == NVME + 1
    eng._sync()
    raw = (tmp_path / "acme" / "nvme.img").read_bytes()
    assert b"PLAINTEXT-MARKER" not in raw
    assert eng.get_chunk("acme", key) == data


def test_dram_overflow_demotes_to_nvme_and_everything_reads_back(eng: Engine) -> None:
    chunks = [chunk(i) for i in range(40)]  # 80 blocks > 32 DRAM blocks
    for key, data in chunks:
        eng.put_chunk("acme", key, data)
        eng.tick()  # demotion copies in the background tick, never inside reserve()
    st = eng.stats("acme")
    assert st["demotions"] >= 20 and st["tiers"]["dram"]["records"] <= 16
    assert st["tiers"]["nvme"]["records"] == 40 - st["tiers"]["dram"]["records"]
    for key, data in chunks:
        assert eng.get_chunk("acme", key) == data


def test_nvme_overflow_drops_coldest(eng: Engine) -> None:
    chunks = [chunk(i) for i in range(100)]  # 200 blocks > 32 + 128
    for key, data in chunks:
        eng.put_chunk("acme", key, data)
    st = eng.stats("acme")
    assert st["evictions"] > 0 and st["records"] == 80
    found = [eng.get_chunk("acme", k) == d for k, d in chunks]
    assert sum(found) == 80 and all(found[-60:])


def test_leased_chunk_survives_pressure_and_extent_is_not_reused(eng: Engine) -> None:
    key, data = chunk(0)
    eng.put_chunk("acme", key, data)
    res = eng.lookup("acme", [key])
    loc = res.hits[0]
    for i in range(1, 120):
        eng.put_chunk("acme", *chunk(i))
    buf = bytearray(loc.block_count * BS)
    eng.namespaces("acme")[loc.nsid].read_into(loc.lba, memoryview(buf))
    assert bytes(buf[: loc.length]) == data  # never moved or overwritten while leased
    eng.release("acme", res.lease_id)  # type: ignore[arg-type]
    assert eng.get_chunk("acme", key) == data


def test_delete_while_leased_defers_the_free(eng: Engine) -> None:
    key, data = chunk(0, 8 * BS)  # NVMe
    eng.put_chunk("acme", key, data)
    res = eng.lookup("acme", [key])
    loc = res.hits[0]
    eng.delete("acme", key)
    assert eng.get_chunk("acme", key) is None
    others = [eng.put_chunk("acme", *chunk(i, 8 * BS)) for i in range(1, 15)]
    assert all(o.lba != loc.lba for o in others if o.nsid == loc.nsid)
    eng.release("acme", res.lease_id)  # type: ignore[arg-type]
    assert eng.put_chunk("acme", *chunk(50, 8 * BS)).lba == loc.lba


def test_reservation_expiry_reclaims_and_commit_raises(eng: Engine, clock: FakeClock) -> None:
    key, data = chunk(1)
    free_before = eng.stats("acme")["tiers"]["dram"]["free_bytes"]
    res = eng.reserve("acme", key, len(data))
    clock.t += 6
    assert eng.tick()["reservations_expired"] == 1
    assert eng.stats("acme")["tiers"]["dram"]["free_bytes"] == free_before
    with pytest.raises(ReservationExpired, match=r"expired .* ms ago.*reserve\(\) again"):
        eng.commit("acme", res.reservation_id, chunk_checksum(key, data))
    res2 = eng.reserve("acme", key, len(data))
    clock.t += 6  # expired but not yet reclaimed by tick(): commit still refuses
    with pytest.raises(ReservationExpired):
        eng.commit("acme", res2.reservation_id, chunk_checksum(key, data))
    assert eng.lookup("acme", [key]).hits == []


def test_lease_expiry_then_release_raises(eng: Engine, clock: FakeClock) -> None:
    key, data = chunk(1)
    eng.put_chunk("acme", key, data)
    res = eng.lookup("acme", [key])
    assert eng.stats()["leases"] == 1
    clock.t += 6
    assert eng.tick()["leases_expired"] == 1
    with pytest.raises(LeaseExpired, match=r"expired .* ms ago"):
        eng.release("acme", res.lease_id)  # type: ignore[arg-type]
    with pytest.raises(LeaseExpired, match="not held"):
        eng.release("acme", 12345)


def test_tier_full_when_everything_is_pinned(eng: Engine) -> None:
    keys = []
    for i in range(80):  # 160 blocks: both tiers full
        key, data = chunk(i)
        eng.put_chunk("acme", key, data)
        keys.append(key)
    for key in eng_keys_present(eng, keys):
        eng.pin("acme", key)
    with pytest.raises(TierFull, match=r"pinned.*unpin"):
        eng.put_chunk("acme", *chunk(500))
    eng.unpin("acme", keys[-1])
    eng.put_chunk("acme", *chunk(500))  # room again once one chunk is evictable


def eng_keys_present(eng: Engine, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if _present(eng, k)]


def _present(eng: Engine, key: bytes) -> bool:
    res = eng.lookup("acme", [key])
    if res.lease_id is not None:
        eng.release("acme", res.lease_id)
    return bool(res.hits)


def test_unknown_key_and_unknown_tenant(eng: Engine) -> None:
    with pytest.raises(UnknownKey, match="no chunk"):
        eng.delete("acme", b"x" * 16)
    with pytest.raises(UnknownKey):
        eng.pin("acme", b"x" * 16)
    with pytest.raises(UnknownTenant, match=r"nobody.*config"):
        eng.lookup("nobody", [b"x" * 16])


def test_quota_evicts_own_chunks_then_refuses_when_pinned(tmp_path: Path) -> None:
    eng = make(tmp_path, tenants={"acme": 10 * BS})
    try:
        for i in range(8):
            eng.put_chunk("acme", *chunk(i))  # 2 blocks each: quota holds 5
        st = eng.stats("acme")
        assert st["records"] == 5 and st["used_bytes"] <= 10 * BS and st["evictions"] == 3
        for i in range(3, 8):
            eng.pin("acme", chunk(i)[0])
        with pytest.raises(QuotaExceeded, match="quota"):
            eng.put_chunk("acme", *chunk(9))
    finally:
        eng.close()


def test_bit_flip_in_backing_file_is_a_miss_and_quarantines(tmp_path: Path, eng: Engine) -> None:
    key, data = chunk(7, 8 * BS)
    loc = eng.put_chunk("acme", key, data)
    assert loc.nsid == NVME + 1
    before = sample_value(
        "kvtier_engine_integrity_failures_total", {"tenant": "acme", "tier": "nvme"}
    )
    with open(tmp_path / "acme" / "nvme.img", "r+b") as f:
        f.seek(loc.lba * BS + 1234)
        byte = f.read(1)[0]
        f.seek(loc.lba * BS + 1234)
        f.write(bytes([byte ^ 0x01]))  # one ciphertext bit: XTS garbles the whole block
    assert eng.get_chunk("acme", key) is None
    st = eng.stats("acme")
    assert st["integrity_failures"] == 1
    assert st["tiers"]["nvme"]["quarantined_bytes"] == 8 * BS
    after = sample_value(
        "kvtier_engine_integrity_failures_total", {"tenant": "acme", "tier": "nvme"}
    )
    assert after == before + 1
    assert eng.lookup("acme", [key]).hits == []
    for i in range(20):  # fill NVMe: the quarantined extent is never handed out
        got = eng.put_chunk("acme", *chunk(100 + i, 8 * BS))
        assert not (got.nsid == loc.nsid and loc.lba <= got.lba < loc.lba + loc.block_count)


def test_corrupt_dram_chunk_is_dropped_not_demoted(eng: Engine) -> None:
    key, data = chunk(0)
    loc = eng.put_chunk("acme", key, data)
    assert loc.nsid == DRAM + 1
    with eng.locked() as state:
        raw = state.tenant("acme").tiers[DRAM].devices.raw  # the mmap under the cipher
    raw.write(loc.lba, os.urandom(BS))
    for i in range(1, 30):
        eng.put_chunk("acme", *chunk(i))
        eng.tick()  # background demotion pushes chunk 0 out of DRAM
    st = eng.stats("acme")
    assert st["integrity_failures"] == 1
    assert eng.get_chunk("acme", key) is None


def test_tenants_are_isolated(tmp_path: Path) -> None:
    eng = make(tmp_path, tenants={"acme": 0, "bravo": 0})
    try:
        key = b"s" * 16
        data = b"same plaintext, two tenants " * 1200
        la = eng.put_chunk("acme", key, data)
        lb = eng.put_chunk("bravo", key, data + b"!")
        assert (la.nsid, la.lba) == (lb.nsid, lb.lba) == (NVME + 1, 0)
        assert eng.get_chunk("acme", key) == data
        assert eng.get_chunk("bravo", key) == data + b"!"
        eng.delete("acme", key)
        assert eng.get_chunk("bravo", key) == data + b"!"
        eng._sync()
        a = (tmp_path / "acme" / "nvme.img").read_bytes()[:BS]
        b = (tmp_path / "bravo" / "nvme.img").read_bytes()[:BS]
        assert a != b  # own XTS keys: same plaintext and LBA, different ciphertext
        assert eng.namespaces("acme")[2] is not eng.namespaces("bravo")[2]
    finally:
        eng.close()


def test_concurrent_puts_and_gets_from_threads(eng: Engine) -> None:
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(base, base + 15):
                key, data = chunk(i, BS)
                eng.put_chunk("acme", key, data)
                got = eng.get_chunk("acme", key)
                assert got is None or got == data
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert eng.stats()["leases"] == 0 and eng.stats()["reservations"] == 0


def test_stats_shape(eng: Engine) -> None:
    eng.put_chunk("acme", *chunk(1))
    st = eng.stats()
    for k in ("records", "hits", "misses", "evictions", "integrity_failures", "leases", "tenants"):
        assert k in st
    tier = st["tenants"]["acme"]["tiers"]["dram"]
    assert tier["capacity_bytes"] == 32 * BS and tier["used_bytes"] == 2 * BS


def test_any_block_device_per_tier_through_the_factory(tmp_path: Path) -> None:
    """SPDK mode hands in devices that encrypt elsewhere: the engine uses them as given."""
    made: dict[tuple[str, int], MemoryBlockDevice] = {}

    def factory(tenant: str, spec: TierSpec) -> TierDevices:
        dev = MemoryBlockDevice(spec.block_count)
        made[(tenant, spec.nsid)] = dev
        return TierDevices(device=dev, raw=dev)

    cfg = EngineConfig(
        data_dir=tmp_path, dram_bytes=8 * BS, nvme_bytes=64 * BS, tenants={"acme": 0}
    )
    eng = Engine(cfg, device_factory=factory, clock=FakeClock())
    try:
        assert eng.namespaces("acme") == {1: made[("acme", 1)], 2: made[("acme", 2)]}
        chunks = [chunk(i) for i in range(10)]  # DRAM holds 4: the rest is demoted
        for key, data in chunks:
            eng.put_chunk("acme", key, data)
        for key, data in chunks:
            assert eng.get_chunk("acme", key) == data
        loc = eng.lookup("acme", [chunks[0][0]]).hits[0]
        buf = bytearray(loc.block_count * BS)
        made[("acme", loc.nsid)].read_into(loc.lba, memoryview(buf))
        assert bytes(buf[: loc.length]) == chunks[0][1]  # plaintext: this device does not encrypt
    finally:
        eng.close()


def test_tick_demotes_in_the_background_to_the_dram_free_target(eng: Engine) -> None:
    chunks = [chunk(i) for i in range(16)]  # 32 blocks: DRAM exactly full
    for key, data in chunks:
        eng.put_chunk("acme", key, data)
    assert eng.stats("acme")["tiers"]["dram"]["free_bytes"] == 0
    assert eng.tick()["demoted"] == 2  # 10% of 32 blocks = 3 blocks: two 2-block chunks
    dram = eng.stats("acme")["tiers"]["dram"]
    assert dram["free_bytes"] == 4 * BS and dram["records"] == 14
    for key, data in chunks:
        assert eng.get_chunk("acme", key) == data
    assert eng.tick()["demoted"] == 0


def test_background_demotion_yields_to_a_reader_that_leased_meanwhile(eng: Engine) -> None:
    for i in range(16):
        eng.put_chunk("acme", *chunk(i))
    nvme_free = eng.stats("acme")["tiers"]["nvme"]["free_bytes"]
    with eng._lock:
        job = eng._mover.start_demotion()
    assert job is not None
    res = eng.lookup("acme", [job.key])  # a host reads the DRAM copy during the move
    assert eng._mover.copy(job, DRAM, NVME)
    with eng._lock:
        assert eng._mover.finish_demotion(job, True) == 0
    assert res.hits[0].nsid == DRAM + 1
    assert eng.lookup("acme", [job.key]).hits[0].nsid == DRAM + 1  # it stayed
    assert eng.stats("acme")["tiers"]["nvme"]["free_bytes"] == nvme_free  # target freed
    eng.release("acme", res.lease_id)  # type: ignore[arg-type]


def test_background_demotion_catches_a_corrupt_dram_chunk(eng: Engine) -> None:
    for i in range(16):
        eng.put_chunk("acme", *chunk(i))
    with eng.locked() as state:
        raw = state.tenant("acme").tiers[DRAM].devices.raw
    for i in range(16):
        loc = eng.lookup("acme", [chunk(i)[0]])
        eng.release("acme", loc.lease_id)  # type: ignore[arg-type]
        raw.write(loc.hits[0].lba, bytes(BS))  # zero every DRAM chunk's first block
    eng.tick()
    assert eng.stats("acme")["integrity_failures"] >= 1
    assert eng.stats("acme")["demotions"] == 0


def test_put_chunk_takes_numpy_arrays(eng: Engine) -> None:
    kv = np.arange(2 * 8 * 64, dtype=np.float16).reshape(2, 8, 64)
    eng.put_chunk("acme", b"n" * 16, kv)
    got = eng.get_chunk("acme", b"n" * 16)
    assert got is not None
    assert np.array_equal(np.frombuffer(got, dtype=np.float16).reshape(kv.shape), kv)


def test_a_key_asked_twice_in_one_lookup_keeps_lease_counts_consistent(eng: Engine) -> None:
    key, data = chunk(1)
    eng.put_chunk("acme", key, data)
    a = eng.lookup("acme", [key, key])
    b = eng.lookup("acme", [key])
    assert len(a.hits) == 1  # a prefix never repeats a chunk: the repeat ends it
    eng.release("acme", a.lease_id)  # type: ignore[arg-type]
    eng.release("acme", b.lease_id)  # type: ignore[arg-type]
    eng.delete("acme", key)  # not leased any more: its blocks are free at once
    assert eng.stats("acme")["tiers"]["dram"]["free_bytes"] == 32 * BS


def test_operator_evict_frees_bytes_but_spares_leased_chunks(eng: Engine) -> None:
    for i in range(10):
        eng.put_chunk("acme", *chunk(i, 8 * BS))  # NVMe, 8 blocks each
    res = eng.lookup("acme", [chunk(0)[0]])
    freed = eng.evict("acme", 3 * 8 * BS)
    assert freed == 3 * 8 * BS and eng.stats("acme")["records"] == 7
    assert eng.evict("acme", 1 << 40) == 6 * 8 * BS  # everything evictable, not the leased one
    assert eng.get_chunk("acme", chunk(0)[0]) == chunk(0, 8 * BS)[1]
    eng.release("acme", res.lease_id)  # type: ignore[arg-type]


def test_abort_gives_the_blocks_back_and_the_id_is_spent(eng: Engine) -> None:
    free = eng.stats("acme")["tiers"]["dram"]["free_bytes"]
    res = eng.reserve("acme", b"a" * 16, 3 * BS)
    assert eng.stats("acme")["tiers"]["dram"]["free_bytes"] == free - 3 * BS
    eng.abort("acme", res.reservation_id)
    assert eng.stats("acme")["tiers"]["dram"]["free_bytes"] == free
    with pytest.raises(ReservationExpired, match="not open"):
        eng.commit("acme", res.reservation_id, bytes(16))


def test_bounded_requests_and_bad_arguments(eng: Engine) -> None:
    with pytest.raises(LimitExceeded, match="4096"):
        eng.lookup("acme", [b"k" * 16] * 4097)
    with pytest.raises(ValueError, match="16 bytes"):
        eng.lookup("acme", [b"short"])
    with pytest.raises(ValueError, match="chunk length 0"):
        eng.reserve("acme", b"k" * 16, 0)
    with pytest.raises(ValueError, match="invalid"):
        eng.add_tenant("Not_Valid")
    eng.add_tenant("acme", quota_bytes=8 * BS)  # idempotent: only the quota changes
    assert eng.stats("acme")["quota_bytes"] == 8 * BS and eng.tenants() == ["acme"]


def test_reservation_ids_say_nothing_of_other_tenants(tmp_path: Path) -> None:
    """Lease and reservation ids came from one counter for every tenant: acme's next id minus
    its last told how many reservations and leases the other tenants had made meanwhile."""
    e = make(tmp_path, tenants={"acme": 0, "other": 0})
    try:
        first = e.reserve("acme", chunk(1)[0], BS).reservation_id
        for i in range(7):
            e.abort("other", e.reserve("other", chunk(10 + i)[0], BS).reservation_id)
        second = e.reserve("acme", chunk(2)[0], BS).reservation_id
        gaps = {second - first}
        for i in range(20):  # random, not a count
            nxt = e.reserve("acme", chunk(20 + i)[0], BS).reservation_id
            gaps.add(nxt - second)
            e.abort("acme", nxt)
        assert 8 not in gaps and len(gaps) > 15, gaps
    finally:
        e.close()
