"""Engine.lookup's paths give the same answers: probes (lease=False) and leased reads, a few
hits (row by row) and many (numpy in bulk), prefixes cut before and after the scalar probes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpu_agent.engine import Engine, EngineConfig, LimitExceeded
from dpu_agent.engine._leases import COUNT_MAX, SCALAR_HITS_MAX
from dpu_agent.engine.index import PREFIX_HEAD_MAX, PREFIX_SCALAR_MAX

BS = 4096
CHUNKS = 80  # more than SCALAR_HITS_MAX and PREFIX_SCALAR_MAX: every path runs


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def eng(tmp_path: Path) -> Iterator[Engine]:
    cfg = EngineConfig(data_dir=tmp_path, dram_bytes=256 * BS, nvme_bytes=256 * BS,
                       lease_ttl_s=5.0, tenants={"acme": 0, "other": 0})  # fmt: skip
    e = Engine(cfg, clock=FakeClock())
    for i in range(CHUNKS):
        e.put_chunk("acme", key(i), bytes([i]) * (BS + i))
    yield e
    e.close()


def _free(e: Engine) -> int:
    return int(e.stats("acme")["tiers"]["dram"]["free_bytes"])


def test_path_thresholds_are_below_the_chunk_count() -> None:
    assert SCALAR_HITS_MAX < CHUNKS and PREFIX_SCALAR_MAX < CHUNKS


def test_bulk_and_row_by_row_hits_agree(eng: Engine) -> None:
    keys = [key(i) for i in range(CHUNKS)]
    bulk = eng.lookup("acme", keys)
    rows = [h for i in range(0, CHUNKS, 8) for h in eng.lookup("acme", keys[i : i + 8]).hits]
    assert bulk.hits == rows
    assert [h.length for h in bulk.hits] == [BS + i for i in range(CHUNKS)]
    with eng.locked() as st:
        cols = st.index.cols
        found = [st.index.find(st.tenant("acme").tenant_id, k) for k in keys]
        assert (cols["access_count"][found] == 2).all()
        assert (cols["lease"][found] == 2).all()  # the bulk lease and one of the small ones


def test_prefix_cut_inside_and_after_the_scalar_probes(eng: Engine) -> None:
    keys = [key(i) for i in range(CHUNKS)]
    head, most = PREFIX_HEAD_MAX, PREFIX_SCALAR_MAX
    for count in (most - 10, CHUNKS):  # probed key by key; the head key by key, then a batch
        for cut in (0, 3, head - 1, head, head + 5, most - 11, most - 1, most, most + 5):
            if cut >= count:
                continue
            asked = [*keys[:cut], key(10_000), *keys[cut + 1 : count]]
            res = eng.lookup("acme", asked, lease=False)
            assert [h.key for h in res.hits] == keys[:cut], (count, cut)


def test_probe_takes_no_lease(eng: Engine) -> None:
    free = _free(eng)
    res = eng.lookup("acme", [key(0), key(1)], lease=False)
    assert len(res.hits) == 2 and res.lease_id is None and res.lease_expires_s == 0.0
    eng.delete("acme", key(0))  # not leased: its blocks are free at once, not deferred
    assert _free(eng) > free
    assert eng.stats("acme")["hits"] >= 2


def test_a_key_asked_many_times_in_a_bulk_lookup_is_released_cleanly(eng: Engine) -> None:
    free = _free(eng)
    res = eng.lookup("acme", [key(5)] * (SCALAR_HITS_MAX + 4))
    assert len(res.hits) == 1  # a prefix never repeats a chunk: the repeat ends it
    eng.release("acme", res.lease_id)  # type: ignore[arg-type]
    eng.delete("acme", key(5))
    assert _free(eng) == free + 2 * BS


def test_leases_stay_per_tenant(eng: Engine) -> None:
    assert eng.lookup("other", [key(0)]).hits == []  # same key, another tenant: a miss


def test_keys_of_every_accepted_type_and_bad_ones_named(eng: Engine) -> None:
    class Key(bytes):
        pass

    asked: list[Any] = [key(0), bytearray(key(1)), Key(key(2))]
    hits = eng.lookup("acme", asked, lease=False).hits
    assert [h.key for h in hits] == [key(i) for i in range(3)]
    with pytest.raises(ValueError, match="16 bytes, got <memory"):
        eng.lookup("acme", [key(0), memoryview(key(1))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="16 bytes, got b'short'"):
        eng.lookup("acme", [key(0), b"short"])


def test_lookup_lists_are_lookup_in_the_reply_shape(eng: Engine) -> None:
    for count in (4, CHUNKS):
        keys = [key(i) for i in range(count)]
        res = eng.lookup("acme", keys, lease=False)
        hits, lease_id, expires_s = eng.lookup_lists("acme", keys, lease=False)
        assert (lease_id, expires_s) == (None, 0.0)
        assert hits == [
            [h.key, h.nsid, h.lba, h.block_count, h.length, h.checksum] for h in res.hits
        ]
    hits, lease_id, expires_s = eng.lookup_lists("acme", [key(0)])
    assert lease_id is not None and expires_s == 5.0 and len(hits) == 1
    eng.release("acme", lease_id)


@pytest.mark.parametrize("count", [2, CHUNKS])  # row by row, and numpy in bulk
def test_a_chunk_at_its_lease_count_limit_refuses_another_lease(eng: Engine, count: int) -> None:
    keys = [key(i) for i in range(count)]
    with eng.locked() as st:
        row = st.index.find(st.tenant("acme").tenant_id, keys[-1])
        st.index.cols["lease"][row] = COUNT_MAX
    with pytest.raises(LimitExceeded, match="leases"):
        eng.lookup("acme", keys)
    assert len(eng.lookup("acme", keys, lease=False).hits) == count  # a probe takes none
    with eng.locked() as st:
        st.index.cols["lease"][row] = 0


@pytest.mark.parametrize("count", [2, CHUNKS])  # row by row, and numpy in bulk
def test_access_count_wraps_instead_of_failing_hot_chunks(eng: Engine, count: int) -> None:
    keys = [key(i) for i in range(count)]
    with eng.locked() as st:
        row = st.index.find(st.tenant("acme").tenant_id, keys[0])
        st.index.cols["access_count"][row] = 0xFFFF_FFFF  # a chunk read 4 billion times
    assert len(eng.lookup("acme", keys, lease=False).hits) == count
    with eng.locked() as st:
        assert st.index.cols["access_count"][row] == 0
