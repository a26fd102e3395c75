"""An agent of thousands of tenants: a first start writes its key and id files once, not once
per tenant, and the admin's `stats` comes in pages that each fit a control frame (every
tenant's rows did not: "reply too large" past ~1,900 tenants of long names)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from dpu_agent.crypto.keystore import KeyStore, KeyStoreError
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.engine.journal import Journal
from kvproto.control import CONTROL_FRAME_BYTES_MAX, STATS_TENANTS_PAGE_MAX, TENANTS_MAX

MANY = 2100  # of the longest names: every tenant's stats rows are ~1.1 MiB, over a frame


def _names(n: int) -> dict[str, int]:
    return {f"{i:04d}" + "t" * 59: 0 for i in range(n)}  # 63 characters, the longest


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logging.disable(logging.INFO)  # a log line per tenant added
    try:
        e = Engine(EngineConfig(data_dir=tmp_path_factory.mktemp("many"), dram_bytes=1 << 20,
                                nvme_bytes=1 << 20, tenants=_names(MANY)))  # fmt: skip
    finally:
        logging.disable(logging.NOTSET)
    e.put_chunk(next(iter(_names(1))), b"\x01" * 16, b"x" * 100)
    yield e
    e.close()


def test_a_first_start_of_many_new_tenants_writes_their_keys_and_ids_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = {"keys": 0, "ids": 0}
    save_keys, save_ids = KeyStore._save, Journal.save_tenant_ids

    def count_keys(self: KeyStore) -> None:
        writes["keys"] += 1
        save_keys(self)

    def count_ids(self: Journal, names: dict[int, str]) -> None:
        writes["ids"] += 1
        save_ids(self, names)

    monkeypatch.setattr(KeyStore, "_save", count_keys)
    monkeypatch.setattr(Journal, "save_tenant_ids", count_ids)
    names = {f"t{i}": 0 for i in range(300)}
    e = Engine(EngineConfig(data_dir=tmp_path, dram_bytes=1 << 20, nvme_bytes=1 << 20,
                            tenants=names))  # fmt: skip
    try:
        # the key file created, then one write for all; the ids once, then once more at the
        # end of the start (as recovered), whatever the number of tenants
        assert writes == {"keys": 2, "ids": 2}
        assert e.tenants() == sorted(names)
        for name in ("t0", "t299"):  # each tenant serves, under its own key
            e.put_chunk(name, b"\x02" * 16, name.encode() * 10)
            assert e.get_chunk(name, b"\x02" * 16) == name.encode() * 10
        e.add_tenant("late")  # one added later: one write of each
        assert writes == {"keys": 3, "ids": 3}
    finally:
        e.close()
    writes.update(keys=0, ids=0)
    e = Engine(EngineConfig(data_dir=tmp_path, dram_bytes=1 << 20, nvme_bytes=1 << 20,
                            tenants={**names, "late": 0}))  # fmt: skip
    try:  # a restart writes no key: every tenant has one
        assert writes["keys"] == 0 and e.get_chunk("t299", b"\x02" * 16) == b"t299" * 10
    finally:
        e.close()


def test_create_missing_keys_skips_known_and_environment_tenants_and_undoes_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"DPUKV_XTS_KEY_ENVT": "ab" * 32 + "cd" * 32}
    ks = KeyStore(tmp_path / "keys.json", env=env)
    first = ks.key_for("old")
    assert ks.create_missing(["old", "envt", "a", "b", "a"]) == ["a", "b"]
    assert ks.key_for("old") == first and ks.tenants() == ["a", "b", "old"]
    assert KeyStore(tmp_path / "keys.json").key_for("a") == ks.key_for("a")  # on disk

    def full(self: KeyStore) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(KeyStore, "_save", full)
    with pytest.raises(OSError):
        ks.create_missing(["c", "d"])
    assert ks.tenants() == ["a", "b", "old"]  # nothing half-added
    monkeypatch.undo()
    with pytest.raises(KeyStoreError, match="would hold over"):
        ks.create_missing([f"x{i}" for i in range(TENANTS_MAX)])
    assert ks.tenants() == ["a", "b", "old"]


def test_engine_stats_of_all_tenants_come_in_pages_with_totals_over_all(many: Engine) -> None:
    names = sorted(_names(MANY))
    first = many.stats()
    assert list(first["tenants"]) == names[:STATS_TENANTS_PAGE_MAX]
    assert first["tenants_next"] == names[STATS_TENANTS_PAGE_MAX - 1]
    assert first["tenants_count"] == MANY and first["records"] == 1  # totals over every tenant
    seen = list(first["tenants"])
    after = first["tenants_next"]
    while after:
        page = many.stats(after=after, limit=700)
        assert 0 < len(page["tenants"]) <= 700 and page["records"] == 1
        seen += page["tenants"]
        after = page["tenants_next"]
    assert seen == names
    assert many.stats(limit=0)["tenants"] == {} and many.stats(after=names[-1])["tenants"] == {}


def test_admin_stats_over_a_real_control_server_fit_a_frame_and_join_every_page(
    many: Engine, tmp_path: Path
) -> None:
    from test_control_server import ADMIN, serving

    from host_shim.client import ControlChannel
    from kvproto.control import ADMIN_TENANT

    with serving(many, unix_path=tmp_path / "ctl.sock") as srv, contextlib.ExitStack() as stack:
        assert srv.tcp_address is not None
        ch = stack.enter_context(ControlChannel(
            f"tcp://{srv.tcp_address[0]}:{srv.tcp_address[1]}", ADMIN_TENANT, ADMIN))  # fmt: skip
        ch.connect()
        page = ch.call("stats")["stats"]  # a page, not "reply too large"
        assert len(page["tenants"]) == STATS_TENANTS_PAGE_MAX
        assert len(msgpack.packb(page)) < CONTROL_FRAME_BYTES_MAX // 1.5
        assert len(ch.call("stats", tenants_limit=5)["stats"]["tenants"]) == 5
        joined = ch.admin_stats()["stats"]
        assert sorted(joined["tenants"]) == sorted(_names(MANY))
        assert joined["records"] == 1 and "tenants_next" not in joined
