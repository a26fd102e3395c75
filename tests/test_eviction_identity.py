"""A policy item is the chunk's identity, not its row: a chunk evicted and put again is a return
that the real Engine's LRU-2 history and ARC/S3-FIFO ghost lists recognise."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.engine import Engine, EngineConfig

BS = 4096
TIER_CHUNKS = 16  # one-block chunks: the NVMe tier holds this many


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 2.0  # past LRU-2's correlated period: every use counts
        return self.t


def _engine(tmp_path: Path, policy: str) -> Engine:
    cfg = EngineConfig(
        data_dir=tmp_path,
        dram_bytes=BS,  # one block, filled first: the NVMe tier and its policy take the rest
        nvme_bytes=TIER_CHUNKS * BS,
        eviction_policy=policy,
        tenants={"acme": 0},
    )
    return Engine(cfg, clock=FakeClock())


def _key(i: int) -> bytes:
    return (0x5EED0000 + i).to_bytes(8, "little") + (7 * i + 1).to_bytes(8, "little")


def _put(eng: Engine, i: int) -> None:
    eng.put_chunk("acme", _key(i), bytes([i % 251]) * (BS - 64))


def _present(eng: Engine, i: int) -> bool:
    return len(eng.lookup("acme", [_key(i)], lease=False).hits) == 1


@pytest.mark.parametrize("policy", ["lru2", "arc", "s3fifo"])
def test_evicted_chunk_put_again_is_seen_as_a_return(tmp_path: Path, policy: str) -> None:
    """A chunk evicted after one use and put again outlives a scan of one-time chunks: its
    history (LRU-2) or ghost entry (ARC, S3-FIFO) marks it as used twice. As a new item (the
    identity was the row) it would be one more one-time chunk and go with the scan."""
    eng = _engine(tmp_path, policy)
    hot = range(100, 100 + TIER_CHUNKS // 2)  # used twice: half the tier, so ghosts have room
    try:
        _put(eng, 10_000)  # fills DRAM
        for i in hot:
            _put(eng, i)
            assert _present(eng, i)
        _put(eng, 0)
        for i in range(1, TIER_CHUNKS // 2 + 1):  # one-time chunks until chunk 0 goes
            _put(eng, i)
        assert not _present(eng, 0)  # evicted (a miss does not touch the policy)
        _put(eng, 0)  # the return
        scan = range(1000, 1000 + 2 * TIER_CHUNKS)  # one-time chunks, twice the tier
        for i in scan:
            _put(eng, i)
        assert _present(eng, 0), f"{policy}: the returning chunk went with the scan"
        assert not _present(eng, scan[0])  # the scan did turn the tier over
    finally:
        eng.close()


def test_two_keys_with_one_policy_hash_are_both_tracked_and_evicted(tmp_path: Path) -> None:
    """Two live keys whose 64-bit items collide stay two items: both are served, both can be
    evicted, and either can come back."""
    from dpu_agent.engine._records import _MASK64, _MIX, item_of

    k0a, k1a, k1b = 0x1234, 0x55, 0x77
    k0b = (k0a ^ (k1a * _MIX) ^ (k1b * _MIX)) & _MASK64
    assert item_of(k0a, k1a) == item_of(k0b, k1b)
    key_a = k0a.to_bytes(8, "little") + k1a.to_bytes(8, "little")
    key_b = k0b.to_bytes(8, "little") + k1b.to_bytes(8, "little")
    eng = _engine(tmp_path, "lru")
    try:
        _put(eng, 10_000)  # fills DRAM
        eng.put_chunk("acme", key_a, b"a" * 100)
        eng.put_chunk("acme", key_b, b"b" * 100)
        assert eng.get_chunk("acme", key_a) == b"a" * 100
        assert eng.get_chunk("acme", key_b) == b"b" * 100
        for i in range(1, 3 * TIER_CHUNKS):  # turns the tier over: both collided keys go
            _put(eng, i)
        assert len(eng.lookup("acme", [key_a], lease=False).hits) == 0
        assert len(eng.lookup("acme", [key_b], lease=False).hits) == 0
        eng.put_chunk("acme", key_b, b"b" * 100)  # and come back
        assert eng.get_chunk("acme", key_b) == b"b" * 100
    finally:
        eng.close()


def _colliding(n: int) -> list[bytes]:
    """`n` keys whose policy items (the 64-bit hash of the key) are all the same: a tenant
    chooses its keys, and the hash is public."""
    from dpu_agent.engine._records import _MASK64, _MIX

    out = []
    for j in range(n):
        k1 = 0x55 + 2 * j
        k0 = (0x1234 ^ (k1 * _MIX)) & _MASK64
        out.append(k0.to_bytes(8, "little") + k1.to_bytes(8, "little"))
    return out


@pytest.mark.parametrize("how", ["delete", "evict"])
@pytest.mark.parametrize("policy", ["lru", "elect"])
def test_colliding_keys_leave_the_policy_when_they_leave_the_tier(
    tmp_path: Path, policy: str, how: str
) -> None:
    """The second of two keys with one hash is tracked as a stand-in item; when the first left
    before it, the second's removal recomputed its item as the plain hash, missed the policy's
    entry and left it naming a dead row: the next eviction chose that row and the agent
    stopped on a broken invariant (a hostile tenant's colliding keys, found by attacking the
    restart order). Both orders, by delete and by eviction, and the tier keeps working."""
    eng = _engine(tmp_path, policy)
    keys = _colliding(4)
    try:
        _put(eng, 10_000)  # fills DRAM
        for k in keys:
            eng.put_chunk("acme", k, b"x" * 100)
        if how == "delete":
            for k in keys:  # the first (the plain hash) first
                eng.delete("acme", k)
        else:
            for i in range(1, 2 * TIER_CHUNKS):  # turns the tier over: the colliding keys go
                _put(eng, i)
        for k in keys:
            assert not eng.lookup("acme", [k], lease=False).hits
        for tier in eng._tenants["acme"].tiers:
            assert len(tier.rows) == len(tier.policy) <= tier.records
        for i in range(100, 100 + 3 * TIER_CHUNKS):  # evictions go on, none of a dead row
            _put(eng, i)
        for k in keys:  # and the keys come back
            eng.put_chunk("acme", k, b"y" * 100)
            assert eng.get_chunk("acme", k) == b"y" * 100
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["lru", "arc", "prefix-run", "lru2"])
def test_item_to_row_map_holds_only_live_chunks(tmp_path: Path, policy: str) -> None:
    """The item -> row map each tier keeps for the policy grows with the chunks the tier holds,
    not with the chunks it ever held: after many turnovers, deletes and returns it has exactly
    the policy's items."""
    eng = _engine(tmp_path, policy)
    try:
        _put(eng, 10_000)
        for i in range(8 * TIER_CHUNKS):
            _put(eng, i % (3 * TIER_CHUNKS))  # returns as well as new chunks
            if i % 5 == 0:
                _present(eng, i // 2)
            if i % 7 == 1 and _present(eng, i - 1):
                eng.delete("acme", _key(i - 1))
        for tier in eng._tenants["acme"].tiers:
            assert len(tier.rows) == len(tier.policy) <= tier.records
    finally:
        eng.close()
