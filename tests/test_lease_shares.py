"""One tenant cannot take the others' leases or reservations (TENANT_LEASES_MAX,
TENANT_RESERVATIONS_MAX: a quarter of each table).

Found attacking the agent: the tables of open leases and reservations (65,536 each) were
bounded only for the whole agent, so one tenant's session that looked up 65,536 times without
releasing (3.6 s over the control plane) made every other tenant's lookups fail ("65536 leases
are open") for as long as it kept refilling; the same with reservations it never committed
(9.3 s) for every tenant's writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine import FakeClock

from dpu_agent.engine import Engine, EngineConfig, LimitExceeded
from dpu_agent.engine._leases import TENANT_LEASES_MAX, TENANT_RESERVATIONS_MAX

BS = 4096


def _engine(tmp_path: Path, clock: FakeClock) -> Engine:
    cfg = EngineConfig(data_dir=tmp_path, dram_bytes=64 * BS,
                       nvme_bytes=(TENANT_RESERVATIONS_MAX + 256) * BS,
                       tenants={"mallory": 0, "bob": 0}, lease_ttl_s=5.0,
                       reservation_ttl_s=5.0)  # fmt: skip
    return Engine(cfg, clock=clock)


def _key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(16 - len(tag), "big")


def test_a_tenant_that_never_releases_fills_only_its_share_of_leases(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = _engine(tmp_path, clock)
    try:
        eng.put_chunk("mallory", _key(b"m", 0), b"x" * 100)
        eng.put_chunk("bob", _key(b"b", 0), b"y" * 100)
        for _ in range(TENANT_LEASES_MAX):
            assert eng.lookup("mallory", [_key(b"m", 0)]).lease_id is not None
        with pytest.raises(LimitExceeded, match="its share"):
            eng.lookup("mallory", [_key(b"m", 0)])
        # the others read on
        got = eng.lookup("bob", [_key(b"b", 0)])
        assert len(got.hits) == 1 and got.lease_id is not None
        eng.release("bob", got.lease_id)
        assert eng.stats("mallory")["leases"] == TENANT_LEASES_MAX
        # the share comes back as its leases expire
        clock.t += 6.0
        assert eng.lookup("mallory", [_key(b"m", 0)]).lease_id is not None
    finally:
        eng.close()


def test_a_tenant_that_never_commits_fills_only_its_share_of_reservations(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = _engine(tmp_path, clock)
    try:
        for i in range(TENANT_RESERVATIONS_MAX):
            eng.reserve("mallory", _key(b"m", i), 1)
        with pytest.raises(LimitExceeded, match="its share"):
            eng.reserve("mallory", _key(b"m", TENANT_RESERVATIONS_MAX), 1)
        # the others write on
        data = b"z" * 100
        res = eng.reserve("bob", _key(b"b", 1), len(data))
        assert res.reservation_id
        eng.put_chunk("bob", _key(b"b", 2), data)
        assert eng.get_chunk("bob", _key(b"b", 2)) == data
        clock.t += 6.0
        assert eng.reserve("mallory", _key(b"m", 1 << 20), 1).reservation_id
    finally:
        eng.close()
