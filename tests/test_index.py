"""RecordIndex against a dict model: inserts, (batch) finds, backward-shift deletes, growth."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.engine.index import NO_ROW, ROW_BYTES, RecordIndex, split_keys


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def _check_model(index: RecordIndex, model: dict[tuple[int, bytes], int]) -> None:
    assert len(index) == len(model)
    for (tenant, key), lba in model.items():
        row = index.find(tenant, key)
        assert row != NO_ROW
        assert int(index.cols["lba"][row]) == lba
        assert index.key_of(row) == key
    if model:
        tenants = np.array([t for t, _ in model], dtype=np.uint16)
        k0, k1 = split_keys([k for _, k in model])
        rows = index.find_many(tenants, k0, k1)
        assert (rows >= 0).all()
        assert list(index.cols["lba"][rows]) == list(model.values())


def test_index_matches_dict_model_under_churn() -> None:
    rng = random.Random(7)
    index = RecordIndex()
    model: dict[tuple[int, bytes], int] = {}
    for step in range(6000):
        if model and rng.random() < 0.4:
            tenant, key = rng.choice(list(model))
            index.remove(index.find(tenant, key))
            del model[(tenant, key)]
        else:
            tenant, key = rng.randint(1, 3), _key(rng)
            index.insert(tenant, key, lba=step, tier=1)
            model[(tenant, key)] = step
        if step % 1500 == 0:
            _check_model(index, model)
    _check_model(index, model)
    absent = [_key(rng) for _ in range(200)]
    assert all(index.find(1, k) == NO_ROW for k in absent)
    k0, k1 = split_keys(absent)
    assert (index.find_many(1, k0, k1) == NO_ROW).all()


def test_same_key_of_two_tenants_is_two_records() -> None:
    index = RecordIndex()
    key = bytes(range(16))
    a = index.insert(1, key, lba=10)
    b = index.insert(2, key, lba=20)
    assert a != b
    assert index.find(1, key) == a and index.find(2, key) == b
    assert index.find(3, key) == NO_ROW
    index.remove(a)
    assert index.find(1, key) == NO_ROW and index.find(2, key) == b


def test_keys_that_collide_on_home_slot_survive_deletion_of_the_first() -> None:
    """Backward shift: deleting the head of a probe run must not hide the keys behind it."""
    index = RecordIndex()
    low = (5).to_bytes(8, "little")
    keys = [low + i.to_bytes(8, "little") for i in range(50)]  # same k0: same home slot
    rows = [index.insert(1, k, lba=i) for i, k in enumerate(keys)]
    for i in range(0, 50, 2):
        index.remove(rows[i])
    for i, k in enumerate(keys):
        assert (index.find(1, k) == NO_ROW) == (i % 2 == 0)


def test_insert_many_then_grow_and_rebuild() -> None:
    rng = np.random.default_rng(3)
    index = RecordIndex()
    n = 50_000
    k0 = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    k1 = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    rows = index.insert_many(
        {"k0": k0, "k1": k1, "tenant": np.ones(n, np.uint16), "lba": np.arange(n, dtype=np.uint64)}
    )
    assert len(set(rows.tolist())) == n
    found = index.find_many(1, k0, k1)
    assert (index.cols["lba"][found] == np.arange(n)).all()
    assert index.nbytes / n < 1.6 * ROW_BYTES


def test_rows_are_reused_after_remove() -> None:
    index = RecordIndex()
    rng = random.Random(1)
    row = index.insert(1, _key(rng))
    index.remove(row)
    assert index.insert(1, _key(rng)) == row


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=200))
def test_index_random_ops_hypothesis(ops: list[tuple[bool, int]]) -> None:
    """Keys drawn from a small pool (with shared k0) exercise collisions and re-inserts."""
    index = RecordIndex()
    model: dict[bytes, int] = {}
    for is_insert, n in ops:
        key = (n % 4).to_bytes(8, "little") + n.to_bytes(8, "little")
        if is_insert and key not in model:
            model[key] = index.insert(1, key, lba=n)
        elif not is_insert and key in model:
            index.remove(model.pop(key))
    for n in range(41):
        key = (n % 4).to_bytes(8, "little") + n.to_bytes(8, "little")
        assert (index.find(1, key) != NO_ROW) == (key in model)


def test_keys_sharing_their_first_bytes_do_not_make_one_probe_run() -> None:
    """A tenant chooses its keys: 4,096 keys with the same first 8 bytes (the old home slot)
    made one run of 4,096 slots, so each probe walked it (a 4,096-key lookup: 265 ms). The
    home is now a secret hash of the whole key and the tenant: their slots are as spread as
    random keys'."""
    idx = RecordIndex()
    keys = [i.to_bytes(16, "big") for i in range(4096)]  # k0 == 0 for every key
    for k in keys:
        idx.insert(3, k)
    slots = idx._slots  # the table itself: how far each key sits from its home slot
    where = {int(r): s for s, r in enumerate(slots.tolist()) if r >= 0}
    distance = [(where[idx.find(3, k)] - idx._home_of(idx.find(3, k))) % len(slots) for k in keys]
    assert max(distance) < 64, max(distance)  # random keys at load <= 0.7: a few dozen at most
    assert all(idx.find(3, k) != NO_ROW for k in keys)
    assert idx.find(4, keys[0]) == NO_ROW  # the tenant is part of the key


def test_removing_a_tenants_records_together_leaves_the_others_findable() -> None:
    """`remove_many`, a tenant's removal: one tenant's rows freed at once and the slot table
    rebuilt (one at a time took 3.8 us a record under the engine lock, 4 s at 1M records;
    an attack pass), or one by one where they are few; the rest found, the rows reused."""
    rng = random.Random(11)
    for removed_share in (3, 200):  # a third of the records (together), a few (one by one)
        index = RecordIndex()
        model: dict[tuple[int, bytes], int] = {}
        for step in range(3000):
            tenant = 1 if step % removed_share == 0 else 2
            key = _key(rng)
            index.insert(tenant, key, lba=step, tier=1)
            model[(tenant, key)] = step
        gone = [k for k in model if k[0] == 1]
        rows = np.array([index.find(t, k) for t, k in gone])
        index.remove_many(rows)
        for t, k in gone:
            del model[(t, k)]
            assert index.find(t, k) == NO_ROW
        _check_model(index, model)
        for step in range(len(gone)):  # the freed rows are taken again, nothing else grows
            key = _key(rng)
            assert index.insert(1, key, lba=10_000 + step, tier=1) in set(rows.tolist())
            model[(1, key)] = 10_000 + step
        _check_model(index, model)
