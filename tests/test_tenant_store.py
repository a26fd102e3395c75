"""TenantStore: tenants.json round-trips what the agent changed at run time, a damaged file costs
only the run-time changes (the configured tenants start), and secrets are 0600 from creation."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from dpu_agent.config import TenantConfig
from dpu_agent.tenant_store import TENANTS_FILE, TenantStore, write_secret


def _store(tmp_path: Path) -> TenantStore:
    return TenantStore(tmp_path / TENANTS_FILE)


def test_missing_file_is_no_change(tmp_path: Path) -> None:
    saved = _store(tmp_path).load()
    assert (saved.added, saved.removed, saved.cluster) == ({}, [], {})


def test_saved_tenants_load_back(tmp_path: Path) -> None:
    store = _store(tmp_path)
    added = {"b": TenantConfig(name="b", token="secret", token_file="tenant-b.token",
                               quota_bytes=1 << 20)}  # fmt: skip
    store.save(added=added, present={"default", "b"}, cluster={"c": "inc-1"},
               configured={"default", "old"}, removed="old")  # fmt: skip
    saved = store.load()
    assert list(saved.added) == ["b"]
    assert saved.added["b"].token_file == "tenant-b.token"
    assert saved.added["b"].quota_bytes == 1 << 20
    assert saved.added["b"].token == ""  # tokens live in their own files, never here
    assert "secret" not in store.path.read_text()
    assert saved.removed == ["old"]
    assert saved.cluster == {"c": "inc-1"}
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_removals_accumulate_until_the_name_is_back(tmp_path: Path) -> None:
    store, configured = _store(tmp_path), {"a", "x", "y"}
    store.save(added={}, present={"a"}, cluster={}, configured=configured, removed="x")
    store.save(added={}, present={"a"}, cluster={}, configured=configured, removed="y")
    assert store.load().removed == ["x", "y"]
    store.save(added={}, present={"a", "x"}, cluster={}, configured=configured)  # x is back
    assert store.load().removed == ["y"]


def test_only_config_tenants_are_remembered_as_removed(tmp_path: Path) -> None:
    """A tenant added at run time needs no record once removed: every name was kept and the
    file, rewritten at each change, grew without bound (150 ms an add after 100k removals,
    an attack pass)."""
    store = _store(tmp_path)
    store.path.write_text(json.dumps({"removed": [f"old{i}" for i in range(1000)] + ["cfg"]}))
    for i in range(50):
        store.save(added={}, present={"a"}, cluster={}, configured={"a", "cfg"}, removed=f"r{i}")
    assert store.load().removed == ["cfg"]


def test_damaged_file_starts_with_the_configured_tenants_and_is_kept(tmp_path: Path) -> None:
    """A damaged file costs the run-time changes, and is set aside: while it is there the
    agent erases no tenant the config does not name (they may be the ones it named)."""
    store = _store(tmp_path)
    for text in ("{not json", "[1, 2]", '"a string"', "[" * 100_000, ""):
        store.path.write_text(text)
        saved = store.load()
        assert (saved.added, saved.removed, saved.cluster) == ({}, [], {}), text
        assert saved.damaged and store.damaged and not store.path.exists()
        assert store.damaged_path.read_text() == text
    # the next save writes a whole file; the damaged one stays until someone deletes it
    store.save(added={}, present=set(), cluster={}, configured={"gone"}, removed="gone")
    assert store.load().removed == ["gone"] and store.load().damaged
    store.damaged_path.unlink()
    assert not store.load().damaged


def test_bad_entries_are_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    store = _store(tmp_path)
    doc = {
        "added": {
            "ok": {"token_file": "tenant-ok.token", "quota_bytes": 5},
            "Bad Name": {"token_file": "x"},
            "notadict": 7,
            "negative": {"quota_bytes": -1},
        },
        "removed": ["r1", 3, "../etc", "r2"],
        "cluster": {"c1": {"incarnation": "i"}, "c2": "not an object"},
    }
    store.path.write_text(json.dumps(doc))
    saved = store.load()
    assert sorted(saved.added) == ["negative", "ok"]
    assert saved.added["negative"].quota_bytes == 0
    assert saved.removed == ["r1", "r2"]
    assert saved.cluster == {"c1": "i"}


def test_write_secret_is_private_from_creation_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "tenant-a.token"
    old_umask = os.umask(0)  # even a permissive umask: the file is never world-readable
    try:
        write_secret(path, "one")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        write_secret(path, "two")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "two\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.with_suffix(".tmp").exists()


def test_a_fifo_in_place_of_the_file_is_set_aside_not_waited_on(tmp_path: Path) -> None:
    """Opening a FIFO waits for a writer: the start hung there (as at the order and key files)."""
    store = _store(tmp_path)
    os.mkfifo(store.path)
    saved = store.load()
    assert saved.damaged and saved.added == {} and not store.path.exists()
