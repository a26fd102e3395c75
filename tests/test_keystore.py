"""KeyStore: 0600 key file, refused when readable by others, env override, rotation."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import structlog

from dpu_agent.crypto import KeyStore, KeyStoreError, XtsCipher, env_var_name


def test_key_file_created_0600_and_keys_persist(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path, env={})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = store.key_for("tenant-a")
    assert len(key) == 64 and key[:32] != key[32:]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.key_for("tenant-a") == key
    assert store.current_generation("tenant-a") == 1
    again = KeyStore(path, env={})
    assert again.key_for("tenant-a") == key
    assert again.tenants() == ["tenant-a"]
    doc = json.loads(path.read_text())
    check = doc["tenant-a"][0]["check"]
    assert doc == {"tenant-a": [{"generation": 1, "key": key.hex(), "check": check}]}
    XtsCipher(key)  # a usable XTS key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_readable_key_file_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "keys.json"
    KeyStore(path, env={}).key_for("t")
    os.chmod(path, mode)
    with pytest.raises(KeyStoreError, match="chmod 600"):
        KeyStore(path, env={})


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_key_file_that_is_not_a_file_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    """A directory in its place said "Is a directory: 6" (a descriptor, not the path); a FIFO
    held the agent's start until something wrote to it (found by an attack pass)."""
    path = tmp_path / "keys.json"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path, 0o600)
    with pytest.raises(KeyStoreError, match=f"key file {path} is not a regular file"):
        KeyStore(path, env={})


def test_env_key_takes_precedence(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    KeyStore(path, env={}).key_for("acme.prod-1")
    env_key = bytes(range(64))
    name = env_var_name("acme.prod-1")
    assert name == "DPUKV_XTS_KEY_ACME_PROD_1"
    store = KeyStore(path, env={name: env_key.hex()})
    assert store.key_for("acme.prod-1") == env_key
    assert store.current_generation("acme.prod-1") == 1
    with pytest.raises(KeyStoreError, match="rotate it there"):
        store.rotate("acme.prod-1")


def test_env_only_store(tmp_path: Path) -> None:
    env_key = bytes(range(64))
    store = KeyStore(None, env={"DPUKV_XTS_KEY_T1": env_key.hex(), "DPUKV_XTS_GEN_T1": "4"})
    assert store.key_for("t1") == env_key
    assert store.key_for("t1", 4) == env_key
    assert store.current_generation("t1") == 4
    with pytest.raises(KeyStoreError, match="no key file"):
        store.key_for("t2")


@pytest.mark.parametrize("value", ["abcd", "zz" * 64, "11" * 64])
def test_bad_env_key_refused_without_echoing_it(value: str) -> None:
    store = KeyStore(None, env={"DPUKV_XTS_KEY_T": value})
    with pytest.raises(KeyStoreError) as info:
        store.key_for("t")
    assert value not in str(info.value)
    assert "DPUKV_XTS_KEY_T" in str(info.value)


def test_rotate_keeps_old_generation(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path, env={})
    old = store.key_for("t")
    assert store.rotate("t") == 2
    new = store.key_for("t")
    assert new != old
    assert store.current_generation("t") == 2
    reloaded = KeyStore(path, env={})
    assert reloaded.key_for("t", 1) == old
    assert reloaded.key_for("t", 2) == new
    assert reloaded.key_for("t") == new
    with pytest.raises(KeyStoreError, match="no key generation 3"):
        reloaded.key_for("t", 3)


def test_remove(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path, env={})
    store.key_for("gone")
    store.key_for("kept")
    store.remove("gone")
    store.remove("gone")  # idempotent
    assert KeyStore(path, env={}).tenants() == ["kept"]
    with pytest.raises(KeyStoreError, match="no key for tenant 'gone' generation 1"):
        store.key_for("gone", 1)


def test_corrupt_key_file_refused_without_echoing_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    secret = "ab" * 63 + "c"  # 127 chars: wrong length
    path.write_text(json.dumps({"t": [{"generation": 1, "key": secret}]}))
    os.chmod(path, 0o600)
    with pytest.raises(KeyStoreError) as info:
        KeyStore(path, env={})
    assert secret not in str(info.value)
    path.write_text('{"t": [{"generation": 1, "key": "' + "ab" * 10)
    with pytest.raises(KeyStoreError, match="not valid JSON") as info:
        KeyStore(path, env={})
    assert "abab" not in str(info.value)


def test_missing_directory_gives_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KeyStoreError, match="cannot write key file"):
        KeyStore(tmp_path / "no" / "such" / "keys.json", env={})


def test_key_never_in_repr_or_logs(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as events:
        store = KeyStore(tmp_path / "keys.json", env={})
        keys = [store.key_for("t")]
        store.rotate("t")
        keys.append(store.key_for("t"))
        store.remove("t")
    logged = json.dumps(events, default=repr)
    assert "keystore.rotated" in logged  # the logger really was captured
    for key in keys:
        for text in (logged, repr(store), str(store)):
            assert key.hex() not in text
            assert key.hex()[:32] not in text
            assert repr(key) not in text


def test_retire_old_generation(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path, env={})
    store.key_for("t")
    store.rotate("t")
    with pytest.raises(KeyStoreError, match="current key"):
        store.retire("t", 2)
    store.retire("t", 1)
    reloaded = KeyStore(path, env={})
    assert reloaded.current_generation("t") == 2
    with pytest.raises(KeyStoreError, match="no key generation 1"):
        reloaded.key_for("t", 1)


def test_a_damaged_key_is_refused_by_its_check_value(tmp_path: Path) -> None:
    """One hex digit of a key changed on disk: the old store loaded it, and every chunk the
    tenant had written failed its check on read (and was quarantined)."""
    path = tmp_path / "keys.json"
    key = KeyStore(path, env={}).key_for("tenant-a")
    doc = json.loads(path.read_text())
    text = doc["tenant-a"][0]["key"]
    doc["tenant-a"][0]["key"] = ("0" if text[5] != "0" else "1").join((text[:5], text[6:]))
    path.write_text(json.dumps(doc))
    with pytest.raises(
        KeyStoreError, match="tenant 'tenant-a' generation 1 does not match its check value"
    ) as e:
        KeyStore(path, env={})
    assert text not in str(e.value) and doc["tenant-a"][0]["key"] not in str(e.value)
    # a file written before check values (no "check") loads, and gets one at its next write
    doc["tenant-a"][0] = {"generation": 1, "key": key.hex()}
    path.write_text(json.dumps(doc))
    old = KeyStore(path, env={})
    assert old.key_for("tenant-a") == key and old.has_key("tenant-a", 1)
    assert not old.has_key("tenant-a", 2) and not old.has_key("tenant-b", 1)
    old.rotate("tenant-a")
    assert all("check" in e for e in json.loads(path.read_text())["tenant-a"])
