"""The record index: chunk key -> record, as packed numpy columns plus an open-addressing table.

A dict of Python objects costs several hundred bytes per record; this layout costs about 100
(88 bytes of columns per row, a 4-byte slot per table entry at load <= 0.7, rows grown by 1.25x),
so 10M records fit in about 1.1 GB of DPU DRAM.

- Rows (record ids) are stable while the record lives: eviction policies and leases refer to them.
  Freed rows are reused from a stack.
- The slot table is linear probing over `int32` row ids (-1 empty) with backward-shift deletion,
  so there are no tombstones and probe lengths stay short under churn. It doubles (rebuilt
  vectorised) when the load passes `LOAD_MAX`.
- The home slot is a secret multiply-shift hash of (tenant, key): the top bits of
  k0*a0 + k1*a1 + tenant*at + c (mod 2^64), with random odd multipliers drawn for each index.
  An honest client's keys are BLAKE2b hashes, but the agent cannot check that: with the key's
  own bits as the home slot (as before), a tenant whose keys shared their first 8 bytes put them
  all in one probe run (a 4,096-key lookup: 265 ms of the event loop, every tenant waiting),
  and its run lengthened other tenants' probes too. Without the multipliers no tenant can
  choose keys that collide more than random ones would.
- `find_many` probes a whole batch of keys with numpy, one probe step per round;
  `find_prefix` (a lookup's question: the longest present prefix) probes the first keys one by
  one and hands the rest to `find_many` only when they all hit.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["COLUMNS", "NO_ROW", "PREFIX_HEAD_MAX", "PREFIX_SCALAR_MAX", "RecordIndex", "split_keys"]

NO_ROW = -1
LOAD_MAX = 0.7  # linear probing: expected probe length is still about 2 at this load
ROW_GROWTH = 1.25  # small growth factor keeps the slack of the row columns <= 25%
ROWS_MIN = 1024
TENANT_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: recovery's key fingerprints
MASK64 = (1 << 64) - 1
_KEY = struct.Struct("<QQ")
STATE_FREE = 0
STATE_LIVE = 1
# find_prefix probes keys one at a time (~0.75 us each on a loaded 2-vCPU machine) and stops at
# the first miss; find_many costs ~40 us for up to ~64 keys, ~140 us for 2048. So a request of
# up to PREFIX_SCALAR_MAX keys is probed key by key; a longer one key by key for its first
# PREFIX_HEAD_MAX keys, then (all of those hit) the rest in one batch.
PREFIX_SCALAR_MAX = 64
PREFIX_HEAD_MAX = 16
# find_many finishes with scalar probes once this few keys are left: a numpy round costs ~15
# scalar probes, and the last keys (misses, long probe runs) would take several rounds.
MANY_TAIL_MAX = 8

# One numpy column per field. 88 bytes per row.
COLUMNS: dict[str, np.dtype] = {
    "k0": np.dtype("<u8"),  # key bytes 0..7 (little-endian)
    "k1": np.dtype("<u8"),  # key bytes 8..15
    "c0": np.dtype("<u8"),  # checksum bytes 0..7
    "c1": np.dtype("<u8"),  # checksum bytes 8..15
    "lba": np.dtype("<u8"),
    "seq": np.dtype("<u8"),  # journal sequence number of the last change (incremental backup)
    "block_count": np.dtype("<u4"),
    "length": np.dtype("<u4"),  # plaintext bytes
    "generation": np.dtype("<u4"),  # key generation the chunk was encrypted under
    "created": np.dtype("<u4"),  # wall-clock seconds (unix)
    "access_count": np.dtype("<u4"),
    "parent": np.dtype("<i4"),  # row of the parent chunk (a hint for eviction), -1 none
    "last_access": np.dtype("<f4"),  # engine-clock seconds since the engine started
    "prev_access": np.dtype("<f4"),  # the access before last (LRU-2 history)
    "pin": np.dtype("<u2"),
    "lease": np.dtype("<u2"),
    "tenant": np.dtype("<u2"),
    "tier": np.dtype("u1"),  # 0 = DRAM, 1 = NVMe
    "state": np.dtype("u1"),  # STATE_FREE / STATE_LIVE
}
ROW_BYTES = sum(dt.itemsize for dt in COLUMNS.values())


def split_keys(keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Keys (16 bytes each) -> (k0, k1) uint64 arrays."""
    for key in keys:
        assert len(key) == 16, key
    words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
    return words[:, 0].copy(), words[:, 1].copy()


@dataclass(frozen=True, slots=True)
class _SlotHash:
    """The secret multiply-shift hash of the slot table (module docstring)."""

    a0: int
    a1: int
    at: int
    c: int

    @classmethod
    def draw(cls) -> _SlotHash:
        r = secrets.randbits
        return cls(a0=r(64) | 1, a1=r(64) | 1, at=r(64) | 1, c=r(64))

    def tenant_term(self, tenant: int) -> int:
        return (tenant * self.at + self.c) & MASK64

    def homes(
        self, k0: np.ndarray, k1: np.ndarray, term: np.ndarray | int, shift: int
    ) -> np.ndarray:
        """Home slots of keys (uint64 words); `term` is tenant_term() of one tenant or of
        each key (uint64). uint64 arithmetic wraps: mod 2^64, as the scalar path masks."""
        h: np.ndarray = k0 * np.uint64(self.a0) + k1 * np.uint64(self.a1)
        h += np.asarray(term, np.uint64)
        return np.right_shift(h, np.uint64(shift)).astype(np.int64)

    def tenant_terms(self, tenant: np.ndarray) -> np.ndarray:
        t = tenant.astype(np.uint64)
        return t * np.uint64(self.at) + np.uint64(self.c)


class RecordIndex:
    """Key -> row map plus the row columns. Not thread-safe: the engine's lock guards it."""

    def __init__(self, rows_hint: int = ROWS_MIN) -> None:
        self.cols: dict[str, np.ndarray] = {}
        self._row_capacity = 0
        self._rows_used = 0  # high-water mark of rows ever handed out
        self._free = np.empty(0, dtype=np.int32)
        self._free_count = 0
        self._count = 0
        self._grow_rows(max(ROWS_MIN, rows_hint))
        size = 1
        while size * LOAD_MAX < max(rows_hint, ROWS_MIN):
            size *= 2
        self._hash = _SlotHash.draw()
        self._slots = np.full(size, NO_ROW, dtype=np.int32)
        self._mask = size - 1
        self._shift = 64 - (size.bit_length() - 1)  # home = the hash's top log2(size) bits
        self._refresh_views()

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of every array the index holds (columns, slot table, free stack)."""
        cols = sum(a.nbytes for a in self.cols.values())
        return cols + self._slots.nbytes + self._free.nbytes

    # --- lookups ---

    def find(self, tenant: int, key: bytes) -> int:
        """Row of (tenant, key), or NO_ROW."""
        k0, k1 = _KEY.unpack(key)
        return self._find_words(tenant, self._hash.tenant_term(tenant), k0, k1)

    def _find_words(self, tenant: int, term: int, k0: int, k1: int) -> int:
        slots, c0, c1, ct = self._views
        mask, h = self._mask, self._hash
        s = ((k0 * h.a0 + k1 * h.a1 + term) & MASK64) >> self._shift
        for _ in range(mask + 1):
            row = slots[s]
            if row < 0:
                return NO_ROW
            if c0[row] == k0 and c1[row] == k1 and ct[row] == tenant:
                return row
            s = (s + 1) & mask
        raise AssertionError("slot table has no empty slot")

    def find_prefix(self, tenant: int, blob: bytes) -> list[int]:
        """Rows of the longest present prefix of the keys packed in `blob` (16 bytes each),
        probed one by one up to the first miss; past PREFIX_SCALAR_MAX keys, only the first
        PREFIX_HEAD_MAX are, and (when they all hit) the rest go to `find_many` in one batch."""
        assert len(blob) % 16 == 0, len(blob)
        count = len(blob) // 16
        head = count if count <= PREFIX_SCALAR_MAX else PREFIX_HEAD_MAX
        term = self._hash.tenant_term(tenant)
        rows: list[int] = []
        for k0, k1 in _KEY.iter_unpack(blob[: 16 * head]):
            row = self._find_words(tenant, term, k0, k1)
            if row == NO_ROW:
                return rows
            rows.append(row)
        if count > head:
            words = np.frombuffer(blob, dtype="<u8", offset=16 * head)
            rest = self.find_many(tenant, words[0::2], words[1::2])
            missing = np.flatnonzero(rest < 0)
            rows += (rest[: int(missing[0])] if len(missing) else rest).tolist()
        return rows

    def find_many(self, tenant: int | np.ndarray, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        """Rows of a batch of keys (NO_ROW for misses), probed with numpy one step per round.
        `tenant` is one tenant id for all keys, or an array of one per key."""
        n, mask = len(k0), self._mask
        c0, c1, ct = self.cols["k0"], self.cols["k1"], self.cols["tenant"]
        tid, per_key = 0, None
        if np.ndim(tenant) == 0:
            tid = int(tenant)
            pos = self._hash.homes(k0, k1, self._hash.tenant_term(tid), self._shift)
        else:
            per_key = np.asarray(tenant, dtype=np.uint16)
            assert per_key.shape == (n,), (per_key.shape, n)
            pos = self._hash.homes(k0, k1, self._hash.tenant_terms(per_key), self._shift)
        out = np.full(n, NO_ROW, dtype=np.int64)
        todo = None  # the first round probes every key: no index array needed yet
        for _ in range(mask + 1):
            rows = self._slots[pos].astype(np.int64)
            empty = rows < 0
            safe = np.where(empty, 0, rows)
            if todo is None:
                want0, want1, want_t = k0, k1, (tid if per_key is None else per_key)
            else:
                want0, want1 = k0[todo], k1[todo]
                want_t = tid if per_key is None else per_key[todo]
            hit = ~empty & (c0[safe] == want0) & (c1[safe] == want1) & (ct[safe] == want_t)
            again = ~empty & ~hit
            if todo is None:
                out[hit] = rows[hit]
                todo = np.flatnonzero(again)
            else:
                out[todo[hit]] = rows[hit]
                todo = todo[again]
            if len(todo) <= MANY_TAIL_MAX:
                for i in todo.tolist():  # from the home slot again: a few probes repeated
                    t = tid if per_key is None else int(per_key[i])
                    term = self._hash.tenant_term(t)
                    out[i] = self._find_words(t, term, int(k0[i]), int(k1[i]))
                return out
            pos = (pos[again] + 1) & mask
        raise AssertionError("slot table has no empty slot")

    def key_of(self, row: int) -> bytes:
        assert self.cols["state"][row] == STATE_LIVE, row
        return int(self.cols["k0"][row]).to_bytes(8, "little") + int(self.cols["k1"][row]).to_bytes(
            8, "little"
        )

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.cols["state"][: self._rows_used] == STATE_LIVE)

    # --- changes ---

    def insert(self, tenant: int, key: bytes, **fields: int | float) -> int:
        """Add a record (the key must be absent) and return its row."""
        assert self.find(tenant, key) == NO_ROW, (tenant, key.hex())
        row = self._take_row()
        cols = self.cols
        for name, value in fields.items():
            cols[name][row] = value
        cols["k0"][row] = int.from_bytes(key[:8], "little")
        cols["k1"][row] = int.from_bytes(key[8:16], "little")
        cols["tenant"][row] = tenant
        cols["state"][row] = STATE_LIVE
        self._count += 1
        self._maybe_grow_slots()
        self._place(row)
        return row

    def insert_many(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """Add a batch of records whose (tenant, key) are all absent and distinct; return rows."""
        n = len(fields["k0"])
        rows = np.empty(n, dtype=np.int64)
        take = min(n, self._free_count)
        rows[:take] = self._free[self._free_count - take : self._free_count][::-1]
        self._free_count -= take
        fresh = n - take
        if self._rows_used + fresh > self._row_capacity:
            self._grow_rows(self._rows_used + fresh)
        first = self._rows_used
        rows[take:] = np.arange(first, first + fresh)
        self._rows_used += fresh
        defaults = {"parent": NO_ROW, "state": STATE_LIVE}
        for name, col in self.cols.items():
            given = fields.get(name) if name != "state" else None
            if given is None:
                col[rows[:take]] = defaults.get(name, 0)
                col[first : first + fresh] = defaults.get(name, 0)
            else:
                col[rows[:take]] = given[:take]
                col[first : first + fresh] = given[take:]  # fresh rows are contiguous
        self._count += n
        if self._count > LOAD_MAX * len(self._slots) or 2 * n > self._count:
            self._rebuild_slots(self._slot_size_for(self._count))  # cheaper than probing rounds
        else:
            self._place_many(rows)
        return rows

    def remove_many(self, rows: np.ndarray) -> None:
        """Delete live `rows` (distinct): one at a time where they are few against the records
        held, else freed together and the slot table rebuilt in one numpy pass (a tenant's
        removal: one at a time took 3.8 us a record under the engine lock, 4 s at 1M)."""
        if len(rows) < 64 or 16 * len(rows) < self._count:
            for row in rows.tolist():
                self.remove(row)
            return
        cols = self.cols
        assert bool(np.all(cols["state"][rows] == STATE_LIVE)), "a row that is not live"
        cols["state"][rows] = STATE_FREE
        cols["pin"][rows] = 0
        cols["lease"][rows] = 0
        self._count -= len(rows)
        need = self._free_count + len(rows)
        self._free_room(need)
        self._free[self._free_count : need] = rows
        self._free_count = need
        self._rebuild_slots(len(self._slots))

    def remove(self, row: int) -> None:
        """Delete a record; backward-shift keeps probe sequences without tombstones."""
        cols = self.cols
        assert cols["state"][row] == STATE_LIVE, row
        mask, slots = self._mask, self._slots
        s = self._home_of(row)
        while int(slots[s]) != row:
            assert int(slots[s]) != NO_ROW, ("row not in slot table", row)
            s = (s + 1) & mask
        hole, j = s, s
        while True:
            j = (j + 1) & mask
            other = int(slots[j])
            if other < 0:
                break
            h = self._home_of(other)
            if ((j - h) & mask) >= ((j - hole) & mask):
                slots[hole] = other
                hole = j
        slots[hole] = NO_ROW
        cols["state"][row] = STATE_FREE
        cols["pin"][row] = 0
        cols["lease"][row] = 0
        self._count -= 1
        self._push_free(row)

    # --- internals ---

    def _home_of(self, row: int) -> int:
        cols, h = self.cols, self._hash
        k0, k1, tenant = int(cols["k0"][row]), int(cols["k1"][row]), int(cols["tenant"][row])
        return ((k0 * h.a0 + k1 * h.a1 + h.tenant_term(tenant)) & MASK64) >> self._shift

    def _homes(self, rows: np.ndarray) -> np.ndarray:
        cols, h = self.cols, self._hash
        terms = h.tenant_terms(cols["tenant"][rows])
        return h.homes(cols["k0"][rows], cols["k1"][rows], terms, self._shift)

    def _take_row(self) -> int:
        if self._free_count:
            self._free_count -= 1
            return int(self._free[self._free_count])
        if self._rows_used == self._row_capacity:
            self._grow_rows(self._rows_used + 1)
        row = self._rows_used
        self._rows_used += 1
        return row

    def _push_free(self, row: int) -> None:
        if self._free_count == len(self._free):
            self._free_room(self._free_count + 1)
        self._free[self._free_count] = row
        self._free_count += 1

    def _free_room(self, needed: int) -> None:
        """The free-row list grown to hold `needed` rows."""
        if needed > len(self._free):
            grown = np.empty(max(ROWS_MIN, int(needed * ROW_GROWTH) + 1), np.int32)
            grown[: self._free_count] = self._free[: self._free_count]
            self._free = grown

    def _grow_rows(self, needed: int) -> None:
        capacity = max(needed, int(self._row_capacity * ROW_GROWTH), ROWS_MIN)
        for name, dtype in COLUMNS.items():
            col = np.zeros(capacity, dtype=dtype)
            if name in self.cols:
                col[: self._row_capacity] = self.cols[name]
            self.cols[name] = col
        self._row_capacity = capacity
        if hasattr(self, "_slots"):
            self._refresh_views()

    def _refresh_views(self) -> None:
        """memoryviews index to plain ints, several times faster than numpy scalars: find(),
        and the engine's reads and writes of a few rows (`col_views`, same names as `cols`)."""
        self._views = (
            self._slots.data,
            self.cols["k0"].data,
            self.cols["k1"].data,
            self.cols["tenant"].data,
        )
        # memoryviews; Any because typeshed types item writes as int, and f4 columns take floats
        self.col_views: dict[str, Any] = {k: c.data for k, c in self.cols.items()}

    def _slot_size_for(self, count: int) -> int:
        size = len(self._slots)
        while count > LOAD_MAX * size:
            size *= 2
        return size

    def _maybe_grow_slots(self) -> None:
        if self._count > LOAD_MAX * len(self._slots):
            self._rebuild_slots(self._slot_size_for(self._count))

    def _rebuild_slots(self, size: int) -> None:
        """Fill an empty table in one pass: rows sorted by home slot take position
        p[i] = max(home[i], p[i-1] + 1), i.e. i + running max of (home - i); the few that run
        past the end wrap around one at a time."""
        self._slots = np.full(size, NO_ROW, dtype=np.int32)
        self._mask = size - 1
        self._shift = 64 - (size.bit_length() - 1)
        self._refresh_views()
        rows = self.live_rows()
        home = self._homes(rows)
        order = np.argsort(home)
        step = np.arange(len(rows))
        pos = np.maximum.accumulate(home[order] - step) + step
        inside = pos < size
        self._slots[pos[inside]] = rows[order[inside]]
        for row in rows[order[~inside]].tolist():
            self._place(row)

    def _place(self, row: int) -> None:
        mask, slots = self._mask, self._slots
        s = self._home_of(row)
        while int(slots[s]) >= 0:
            s = (s + 1) & mask
        slots[s] = row

    def _place_many(self, rows: np.ndarray) -> None:
        """Linear-probing insertion of many rows at once: each round claims free slots."""
        pending = np.asarray(rows, dtype=np.int64)
        pos = self._homes(pending)
        for _ in range(len(self._slots)):
            if len(pending) == 0:
                return
            free = self._slots[pos] < 0
            # several rows may aim at one free slot: one write wins, the others probe on
            self._slots[pos[free]] = pending[free]
            placed = free & (self._slots[pos] == pending)
            pending = pending[~placed]
            pos = (pos[~placed] + 1) & self._mask
        raise AssertionError("slot table has no empty slot")
