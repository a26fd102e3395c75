"""Restart behaviour: clean close keeps DRAM chunks, quarantine persists, a restart hands the
policy back the order it had (at a clean close, or at the last periodic save before a crash;
recovered chunks it does not name go before ones used since the restart), and a recovered
engine keeps working."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from test_engine import FakeClock

from dpu_agent.crypto import KeyStore, KeyStoreError
from dpu_agent.engine import DRAM, NVME, Engine, EngineConfig

BS = 4096


def cfg(tmp_path: Path, nvme_blocks: int = 128) -> EngineConfig:
    return EngineConfig(
        data_dir=tmp_path,
        dram_bytes=32 * BS,
        nvme_bytes=nvme_blocks * BS,
        eviction_policy="lru",
        tenants={"acme": 0},
    )


def chunk(i: int, blocks: int = 2) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), bytes([i % 256]) * (blocks * BS - 50)


def test_clean_close_demotes_dram_chunks_so_they_survive(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    loc = eng.put_chunk("acme", *chunk(1))
    assert loc.nsid == DRAM + 1
    eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
        assert eng.lookup("acme", [chunk(1)[0]]).hits[0].nsid == NVME + 1
    finally:
        eng.close()


def test_quarantine_survives_restart_until_cleared(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path))
    loc = eng.put_chunk("acme", *chunk(1, blocks=8))
    with open(tmp_path / "acme" / "nvme.img", "r+b") as f:
        f.seek(loc.lba * BS)
        f.write(b"\xff" * 16)
    assert eng.get_chunk("acme", chunk(1)[0]) is None
    eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        nvme = eng.stats("acme")["tiers"]["nvme"]
        assert nvme["quarantined_bytes"] == 8 * BS
        assert nvme["free_bytes"] == (128 - 8) * BS
        assert eng.clear_quarantine("acme") == 8
        assert eng.stats("acme")["tiers"]["nvme"]["free_bytes"] == 128 * BS
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.stats("acme")["tiers"]["nvme"]["quarantined_bytes"] == 0
    finally:
        eng.close()


def crash_after_close(tmp_path: Path) -> None:
    """Make the clean close just done look like a crash (no clean-stop marker)."""
    from dpu_agent.engine.engine import CLEAN_STOP

    (cfg(tmp_path).journal_path / CLEAN_STOP).unlink()


def test_after_an_unclean_stop_recovered_chunks_unused_since_are_evicted_first(
    tmp_path: Path,
) -> None:
    eng = Engine(cfg(tmp_path, nvme_blocks=64))
    for i in range(8):  # 8 x 8 blocks: NVMe full
        eng.put_chunk("acme", *chunk(i, blocks=8))
    eng.close()
    crash_after_close(tmp_path)
    eng = Engine(cfg(tmp_path, nvme_blocks=64))
    try:
        assert eng.recovery_report.records == 8
        assert eng.get_chunk("acme", chunk(0)[0]) == chunk(0, 8)[1]  # used since the restart
        for i in range(100, 104):
            eng.put_chunk("acme", *chunk(i, blocks=8))  # evicts 4 recovered chunks
        present = [eng.get_chunk("acme", chunk(i)[0]) is not None for i in range(8)]
        assert present[0]  # the one used after the restart stayed
        assert sum(present) == 4
        for i in range(100, 104):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i, 8)[1]
    finally:
        eng.close()


def test_pinned_recovered_chunk_is_never_evicted(tmp_path: Path) -> None:
    eng = Engine(cfg(tmp_path, nvme_blocks=32))
    for i in range(4):
        eng.put_chunk("acme", *chunk(i, blocks=8))
    eng.close()
    eng = Engine(cfg(tmp_path, nvme_blocks=32))
    try:
        eng.pin("acme", chunk(0)[0])
        for i in range(100, 110):
            eng.put_chunk("acme", *chunk(i, blocks=8))
        assert eng.get_chunk("acme", chunk(0)[0]) == chunk(0, 8)[1]
    finally:
        eng.close()


def test_key_rotation_does_not_strand_existing_nvme_chunks(tmp_path: Path) -> None:
    """The NVMe tier reopens with the key generation its chunks were written under."""
    eng = Engine(cfg(tmp_path))
    eng.put_chunk("acme", *chunk(1, blocks=8))
    eng.close()
    assert KeyStore(tmp_path / "keys.json").rotate("acme") == 2
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1, 8)[1]
        eng.put_chunk("acme", *chunk(2, blocks=8))
        eng.put_chunk("acme", *chunk(3))  # DRAM: the new key; demoted at close
        assert eng.get_chunk("acme", chunk(2)[0]) == chunk(2, 8)[1]
        assert eng.stats("acme")["integrity_failures"] == 0
    finally:
        eng.close()
    eng = Engine(cfg(tmp_path))
    try:
        for i, blocks in ((1, 8), (2, 8), (3, 2)):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i, blocks)[1]
    finally:
        eng.close()


@pytest.mark.parametrize("damage", ["deleted", "emptied", "tenant gone"])
def test_a_tenant_whose_nvme_key_is_gone_stops_the_start(tmp_path: Path, damage: str) -> None:
    """The old engine made the tenant a new key at start, silently: every chunk then failed
    its check on read and was quarantined, and putting the key file back recovered nothing."""
    eng = Engine(cfg(tmp_path))
    eng.put_chunk("acme", *chunk(1, blocks=8))
    eng.close()
    keys = tmp_path / "keys.json"
    saved = keys.read_bytes()
    if damage == "deleted":
        keys.unlink()
    elif damage == "emptied":
        keys.write_bytes(b"")
    else:
        keys.write_text("{}")
    with pytest.raises(KeyStoreError, match=r"tenant 'acme' has chunks in .* key generation 1"):
        Engine(cfg(tmp_path))
    keys.write_bytes(saved)  # the operator restores the file: nothing was lost
    keys.chmod(0o600)
    eng = Engine(cfg(tmp_path))
    try:
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1, 8)[1]
        assert eng.stats("acme")["integrity_failures"] == 0
    finally:
        eng.close()
    # giving the data up: a tenant not configured starts (it is erased after the start)
    keys.unlink()
    eng = Engine(dataclasses.replace(cfg(tmp_path), tenants={}))
    eng.close()


def test_a_restart_begins_each_tiers_election_with_the_leader_it_had(tmp_path: Path) -> None:
    """`elect`'s leader is written beside the checkpoint and given back at the next start,
    for each tenant and tier. A damaged or
    hostile file costs the restart its leader, never the start."""
    import dataclasses
    import json

    from dpu_agent.engine.engine import POLICY_STATE

    elect = dataclasses.replace(cfg(tmp_path), eviction_policy="elect")
    eng = Engine(elect)
    assert eng.policy_state() == {
        "acme": {"dram": {"leader": "prefix-run"}, "nvme": {"leader": "prefix-run"}}
    }
    eng.put_chunk("acme", *chunk(1))
    assert eng.restore_policies({"acme": {"nvme": {"leader": "s3fifo"}}, "ghost": {}}) == 1
    eng.close()
    state = json.loads((elect.journal_path / POLICY_STATE).read_text())
    assert state["acme"]["nvme"] == {"leader": "s3fifo"}
    eng = Engine(elect)
    try:
        assert eng.policy_state()["acme"] == {
            "dram": {"leader": "prefix-run"}, "nvme": {"leader": "s3fifo"},
        }  # fmt: skip
        assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
    finally:
        eng.close()
    path = elect.journal_path / POLICY_STATE
    for damaged in (
        b"{not json",
        b"[1, 2]",
        b'{"acme": {"nvme": {"leader": 7}}}',
        b"x" * (2 << 20),
        b"[" * 200_000,  # nested past the parser's recursion limit: refused every start
        b'{"acme": ' * 100_000,
        None,  # a FIFO: opening it waited for a writer, and the start never ended
    ):
        path.unlink(missing_ok=True)
        if damaged is None:
            os.mkfifo(path)
        else:
            path.write_bytes(damaged)
        eng = Engine(elect)
        try:
            assert eng.policy_state()["acme"]["nvme"] == {"leader": "prefix-run"}
            assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
        finally:
            eng.close()


def test_the_policy_state_is_rewritten_only_when_a_leader_changed(tmp_path: Path) -> None:
    """A checkpoint comes often and the file costs two fsyncs: it is replaced only when what it
    holds changed."""
    import dataclasses
    import json

    from dpu_agent.engine.engine import POLICY_STATE

    elect = dataclasses.replace(cfg(tmp_path), eviction_policy="elect")
    eng = Engine(elect)
    try:
        path = elect.journal_path / POLICY_STATE
        eng.checkpoint()
        first = path.stat().st_ino
        eng.checkpoint()
        assert path.stat().st_ino == first  # unchanged: not replaced
        eng.restore_policies({"acme": {"nvme": {"leader": "s3fifo"}}})
        eng.checkpoint()
        assert path.stat().st_ino != first
        assert json.loads(path.read_text())["acme"]["nvme"] == {"leader": "s3fifo"}
    finally:
        eng.close()


def hot_and_cold(tmp_path: Path, policy: str, leader: str | None = None) -> EngineConfig:
    """A tier of 16 chunks: 4 hot ones used again and again, then 12 one-off ones; `elect`
    leading with `leader` at the close (so the next start switches to it)."""
    import dataclasses

    config = dataclasses.replace(  # DRAM of one block: every chunk is the NVMe tier's
        cfg(tmp_path, nvme_blocks=32), eviction_policy=policy, dram_bytes=BS
    )
    clock = FakeClock()
    eng = Engine(config, clock=clock)
    for i in range(4):
        eng.put_chunk("acme", *chunk(i))
    for _ in range(3):
        clock.t += 10.0  # apart: LRU-2 counts a burst within a second as one reference
        for i in range(4):
            assert eng.lookup("acme", [chunk(i)[0]]).hits
    for i in range(100, 112):
        eng.put_chunk("acme", *chunk(i))
    if leader is not None:
        assert eng.restore_policies({"acme": {"nvme": {"leader": leader}}}) == 1
    eng.close()
    return config


@pytest.mark.parametrize(
    ("policy", "leader"),
    [("elect", None), ("elect", "prefix"), ("prefix-run", None), ("s3fifo", None),
     ("lru2", None)],
)  # fmt: skip
def test_a_clean_restart_keeps_what_the_policy_protected(
    tmp_path: Path, policy: str, leader: str | None
) -> None:
    """The policy's order is saved at a clean close and taken over at the next start: chunks
    the policy protected (used again and again) outlive one-off chunks put after the restart,
    and those outlive the recovered one-off chunks, as without a restart. Before, every
    recovered chunk not used since the restart went first, the hot ones among them. With
    `elect` switching to its saved leader at the start, the leader's times were on another
    clock than the puts after it, so new chunks went before every recovered one."""
    from dpu_agent.engine._restart_order import POLICY_ORDER

    config = hot_and_cold(tmp_path, policy, leader)
    assert (config.journal_path / POLICY_ORDER).exists()
    eng = Engine(config)
    try:
        assert (config.journal_path / POLICY_ORDER).exists()  # kept until the next save
        for i in range(200, 210):  # 10 one-off chunks: 10 evictions
            eng.put_chunk("acme", *chunk(i))
        assert all(eng.lookup("acme", [chunk(i)[0]]).hits for i in range(4)), policy
        for i in range(200, 210):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i)[1]
    finally:
        eng.close()


def test_after_a_crash_the_order_of_the_last_save_is_taken_over(tmp_path: Path) -> None:
    """`tick()` saves the order every `policy_order_save_s`: after a crash (no clean close) the
    next start hands the policy the order of the last save. The hot chunks outlive one-off
    chunks put after the restart; chunks put after the save wait in the cold list and go
    first. Before, an unclean stop threw the order away and the hot chunks went first."""
    import dataclasses
    import shutil

    from structlog.testing import capture_logs

    from dpu_agent.engine._restart_order import POLICY_ORDER

    config = dataclasses.replace(
        cfg(tmp_path, nvme_blocks=32), eviction_policy="elect", dram_bytes=BS,
        policy_order_save_s=30.0,
    )  # fmt: skip
    clock = FakeClock()
    eng = Engine(config, clock=clock)
    for i in range(4):
        eng.put_chunk("acme", *chunk(i))
    for _ in range(3):
        clock.t += 10.0
        for i in range(4):
            assert eng.lookup("acme", [chunk(i)[0]]).hits
    for i in range(100, 108):
        eng.put_chunk("acme", *chunk(i))
    eng.tick()  # 30 s since the start: the order is saved
    saved = tmp_path / "saved-order.npz"
    shutil.copy(config.journal_path / POLICY_ORDER, saved)
    clock.t += 1.0
    for i in range(108, 112):  # after the save: in the cold list after the crash
        eng.put_chunk("acme", *chunk(i))
    eng.tick()  # not due again
    assert (config.journal_path / POLICY_ORDER).read_bytes() == saved.read_bytes()
    eng.close()
    shutil.copy(saved, config.journal_path / POLICY_ORDER)  # what a kill -9 leaves
    crash_after_close(tmp_path)
    with capture_logs() as logs:
        eng = Engine(config)
    try:
        adopted = [e for e in logs if e["event"] == "engine.policy_order_adopted"]
        assert adopted and adopted[0]["items"] == 12
        assert adopted[0]["previous_stop"] == "unclean"
        recovered = [e for e in logs if e["event"] == "engine.recovered"]
        assert recovered[0]["previous_stop"] == "unclean"  # it said "first" after every stop
        for i in range(200, 206):  # 6 evictions: the 4 put after the save, then 2 one-offs
            eng.put_chunk("acme", *chunk(i))
        assert all(eng.lookup("acme", [chunk(i)[0]]).hits for i in range(4))
        assert not any(eng.lookup("acme", [chunk(i)[0]]).hits for i in range(108, 112))
        for i in range(200, 206):
            assert eng.get_chunk("acme", chunk(i)[0]) == chunk(i)[1]
    finally:
        eng.close()
    with pytest.raises(ValueError, match="policy_order_save_s"):
        dataclasses.replace(config, policy_order_save_s=0)


def test_a_damaged_order_file_starts_as_before(tmp_path: Path) -> None:
    """A damaged, oversized or zip-bomb order file, or anything but a regular file in its
    place, is logged and removed; the start goes on, the recovered chunks in the cold list.
    (An attack pass found damage that stopped every start, and a FIFO that hung it.)"""
    import io
    import zipfile

    import numpy as np
    from structlog.testing import capture_logs

    from dpu_agent.engine._restart_order import POLICY_ORDER

    config = hot_and_cold(tmp_path, "elect")
    bomb = io.BytesIO()  # 24 MB of zeros in a few KB: refused before it is inflated
    np.savez_compressed(bomb, **{"items/acme": np.zeros(3 << 20, np.uint64)})

    def npz(**arrays: Any) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def zipped(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", method) as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return buf.getvalue()

    deflated = bytearray(zipped({"items/acme.npy": bytes(4000)}, zipfile.ZIP_DEFLATED))
    deflated[60:80] = bytes(range(20))  # damaged compressed bytes
    method99 = bytearray(npz(**{"items/acme": np.zeros(3, np.uint64)}))
    central = method99.index(b"PK\x01\x02")  # one field of the saved file changed
    method99[central + 10 : central + 12] = (99).to_bytes(2, "little")
    zero_d = {"items/acme": np.array(7, np.uint64), "used/acme": np.array(True)}
    for damaged in (
        b"",
        b"PK\x03\x04 not a zip",
        b"\x93NUMPY" + bytes(100),
        bomb.getvalue(),
        npz(**zero_d),  # 0-d arrays: "too many indices" escaped and stopped every start
        zipped({"items/acme": b"raw", "used/acme": b"bytes"}),  # members that are not .npy
        bytes(method99),  # "compression method not supported"
        bytes(deflated),  # zlib.error
        None,  # a FIFO: opening it waited for a writer, and the start never ended
    ):
        path = config.journal_path / POLICY_ORDER
        path.unlink(missing_ok=True)
        if damaged is None:
            os.mkfifo(path)
        else:
            path.write_bytes(damaged)
        with capture_logs() as logs:
            eng = Engine(config)
        try:
            assert not path.exists()
            assert any(e["event"] == "engine.policy_order_unreadable" for e in logs), damaged
            assert eng.get_chunk("acme", chunk(1)[0]) == chunk(1)[1]
        finally:
            eng.close()


def test_the_adoption_budget_unused_by_a_small_tenant_goes_to_the_larger_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saved order holds at most ADOPT_ITEMS_MAX items of all tenants: a tenant holding
    fewer than an even share keeps all of its own and the rest goes to the others (an even
    split left it unused). Each policy is asked for its share only, so the engine lock is held
    for that many items of each tier, not the whole tier."""
    import dataclasses

    import numpy as np
    from structlog.testing import capture_logs

    from dpu_agent.engine import _restart_order
    from dpu_agent.engine._restart_order import POLICY_ORDER

    monkeypatch.setattr(_restart_order, "ADOPT_ITEMS_MAX", 12)
    config = dataclasses.replace(
        cfg(tmp_path, nvme_blocks=64), eviction_policy="elect", dram_bytes=BS,
        tenants={"small": 0, "large": 0},
    )  # fmt: skip
    eng = Engine(config)
    for i in range(3):
        eng.put_chunk("small", *chunk(i))
    for i in range(100, 116):
        eng.put_chunk("large", *chunk(i))
    asked: dict[int, int | None] = {}  # what each tenant's policy was asked to copy
    for ts in eng._tenants.values():
        policy = ts.tiers[NVME].policy
        real = policy.resident_later

        def spy(limit: int | None = None, real: Any = real, held: int = len(policy)) -> Any:
            asked[held] = limit
            return real(limit)

        monkeypatch.setattr(policy, "resident_later", spy)
    eng.close()
    assert asked == {3: 3, 16: 9}  # under the lock, each copies its share alone
    with np.load(config.journal_path / POLICY_ORDER) as z:
        assert len(z["items/small"]) == 3
        assert len(z["items/large"]) == 9  # 12 - 3; an even split gave it 6
    with capture_logs() as logs:
        eng = Engine(config)
    try:
        adopted = [e for e in logs if e["event"] == "engine.policy_order_adopted"]
        assert adopted[0]["items"] == 12
        for i in (0, 1, 2, 115):
            name = "small" if i < 100 else "large"
            assert eng.get_chunk(name, chunk(i)[0]) == chunk(i)[1]
    finally:
        eng.close()


def test_a_save_the_disk_refuses_is_logged_and_the_last_file_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick's save on a full or failing disk: logged, the tick and the engine go on, the
    file of the save before stays for the next start."""
    import dataclasses
    import errno

    from structlog.testing import capture_logs

    from dpu_agent.engine import _restart_order
    from dpu_agent.engine._restart_order import POLICY_ORDER

    config = dataclasses.replace(
        cfg(tmp_path), eviction_policy="elect", dram_bytes=BS, policy_order_save_s=10.0
    )
    clock = FakeClock()
    eng = Engine(config, clock=clock)
    try:
        eng.put_chunk("acme", *chunk(1))
        clock.t += 10.0
        eng.tick()
        before = (config.journal_path / POLICY_ORDER).read_bytes()
        eng.put_chunk("acme", *chunk(2))

        def full(path: Path, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_restart_order.jr, "replace_file", full)
        clock.t += 10.0
        with capture_logs() as logs:
            eng.tick()
        assert any(e["event"] == "engine.policy_order_not_written" for e in logs)
        assert (config.journal_path / POLICY_ORDER).read_bytes() == before
        assert eng.get_chunk("acme", chunk(2)[0]) == chunk(2)[1]
    finally:
        monkeypatch.undo()
        eng.close()
