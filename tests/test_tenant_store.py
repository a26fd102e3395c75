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
    store.save(added=added, present={"default", "b"}, cluster={"c": "inc-1"}, removed="old")
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
    store = _store(tmp_path)
    store.save(added={}, present={"a"}, cluster={}, removed="x")
    store.save(added={}, present={"a"}, cluster={}, removed="y")
    assert store.load().removed == ["x", "y"]
    store.save(added={}, present={"a", "x"}, cluster={})  # x added again at run time
    assert store.load().removed == ["y"]


def test_damaged_file_starts_with_the_configured_tenants(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for text in ("{not json", "[1, 2]", '"a string"'):
        store.path.write_text(text)
        saved = store.load()
        assert (saved.added, saved.removed, saved.cluster) == ({}, [], {}), text
    # and the next save replaces it with a whole file
    store.save(added={}, present=set(), cluster={}, removed="gone")
    assert store.load().removed == ["gone"]


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
