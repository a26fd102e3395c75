"""Issue 11, item 16: the engine was one class split by inheritance over three files, with a
mixin declaring its state for mypy. Now `Engine` is a facade over parts that own their state
and import in one direction; these tests keep it that way, and drive the parts' small
interfaces without the facade (the rules the facade relies on hold in the parts themselves).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dpu_agent.crypto import KeyStore
from dpu_agent.engine import EmbeddedDevices, Engine, EngineConfig, recovery
from dpu_agent.engine._commit import CommitLog
from dpu_agent.engine._leases import Leases
from dpu_agent.engine._records import Records
from dpu_agent.engine._tenants import Tenants
from dpu_agent.engine.errors import JournalUnavailable
from dpu_agent.engine.index import NO_ROW, RecordIndex
from dpu_agent.engine.journal import JournalError
from dpu_agent.engine.tiers import NVME
from dpu_agent.engine.types import Lease, PendingReservation

ENGINE_DIR = Path(__file__).resolve().parents[1] / "dpu_agent" / "engine"
# the parts, lowest first: each may import only parts before it (one direction, no cycle)
LAYERS = ("_commit", "_tenants", "_leases", "_records", "_placement", "_movement", "_reads",
          "_views", "engine")  # fmt: skip
KEY = b"k" * 16
CHECKSUM = b"c" * 16


def _part_imports(name: str) -> set[str]:
    tree = ast.parse((ENGINE_DIR / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpu_agent.engine."):
            found.add(node.module.rsplit(".", 1)[1])  # type: ignore[union-attr]
    return found & set(LAYERS)


def test_parts_import_in_one_direction() -> None:
    for i, name in enumerate(LAYERS):
        later = _part_imports(name) - set(LAYERS[:i])
        assert not later, f"{name} imports {later}: a part may import only the parts below it"


def test_engine_is_a_facade_not_an_inheritance_chain() -> None:
    assert Engine.__mro__ == (Engine, object)
    for name in LAYERS[:-1]:
        module = __import__(f"dpu_agent.engine.{name}", fromlist=["x"])
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                assert cls.__bases__ == (object,), (name, cls_name, cls.__bases__)


def _parts(tmp_path: Path) -> tuple[RecordIndex, CommitLog, Tenants, Leases, Records]:
    cfg = EngineConfig(data_dir=tmp_path, dram_bytes=16 * 4096, nvme_bytes=64 * 4096)
    index = RecordIndex()
    tenants = Tenants(cfg, EmbeddedDevices(tmp_path, KeyStore(tmp_path / "keys.json")))
    commit = CommitLog(cfg.journal_path)
    recovery.recover(commit, tenants, index, {})
    tenants.build("acme", tenants.free_ids(1)[0], 0)
    leases = Leases(index, tenants, commit)
    records = Records(index, commit, leases, epoch=0.0, wall_clock=lambda: 1.0)
    return index, commit, tenants, leases, records


def _commit_one(tenants: Tenants, records: Records, blocks: int = 2) -> tuple[int, int]:
    ts = tenants["acme"]
    lba = ts.tiers[NVME].alloc.alloc(blocks)
    assert lba is not None
    res = PendingReservation(reservation_id=1, tenant_id=ts.tenant_id, key=KEY, length=4096,
                             parent=None, tier=NVME, lba=lba, block_count=blocks,
                             expires=0.0)  # fmt: skip
    return records.insert(ts, res, CHECKSUM, 0.0), lba


def test_a_dropped_record_keeps_its_extent_until_the_last_lease_ends(tmp_path: Path) -> None:
    index, commit, tenants, leases, records = _parts(tmp_path)
    try:
        ts = tenants["acme"]
        row, lba = _commit_one(tenants, records)
        free = ts.tiers[NVME].alloc.free_blocks
        leases.lease_extent(ts.tenant_id, NVME, lba, row)
        lease = Lease(lease_id=7, tenant_id=ts.tenant_id, extents=[(NVME, lba, 2, row)],
                      expires=float("inf"))  # fmt: skip
        records.drop(ts, row)
        assert index.find(ts.tenant_id, KEY) == NO_ROW
        assert ts.tiers[NVME].alloc.free_blocks == free  # deferred, not freed under a reader
        assert leases.deferred == {(ts.tenant_id, NVME, lba): (2, False)}
        leases.unlease(lease)
        assert ts.tiers[NVME].alloc.free_blocks == free + 2
        assert leases.deferred == {}
    finally:
        commit.journal.close()


def test_a_fenced_commit_log_changes_no_record(tmp_path: Path) -> None:
    index, commit, tenants, _leases, records = _parts(tmp_path)
    try:
        ts = tenants["acme"]
        row, _lba = _commit_one(tenants, records)
        commit.set_fence(JournalError("injected: disk gone", 5))
        with pytest.raises(JournalUnavailable):
            records.drop(ts, row)  # journal first: refused, so the index keeps the record
        assert index.find(ts.tenant_id, KEY) == row
        assert ts.tiers[NVME].records == 1
        commit.try_lift_fence()  # the disk works again: the probe lifts the fence
        assert commit.fence is None
        records.drop(ts, row)
        assert index.find(ts.tenant_id, KEY) == NO_ROW
    finally:
        commit.journal.close()
