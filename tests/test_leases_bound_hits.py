"""A tenant's open leases are bounded by the hits they hold, not only by their number, and a
lookup's prefix ends at a repeated key. Found by an attack pass: one 4 KiB chunk asked for 4,096
times per lookup, on a few connections, never released: ~400 KB a lease, +300 MiB of agent
memory, the other tenants' requests at 240 ms (its share of leases allowed 6 GB)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_engine import FakeClock
from test_engine_restart import BS, cfg, chunk

from dpu_agent.engine import Engine, LimitExceeded


def test_a_lookup_prefix_ends_at_a_repeated_key(tmp_path: Path) -> None:
    eng = Engine(dataclasses.replace(cfg(tmp_path), dram_bytes=64 * BS))
    try:
        for i in (1, 2):
            eng.put_chunk("acme", *chunk(i))
        a, b = chunk(1)[0], chunk(2)[0]
        assert len(eng.lookup("acme", [a] * 4096).hits) == 1
        assert [h.key for h in eng.lookup("acme", [a, b, a, b]).hits] == [a, b]
    finally:
        eng.close()


def test_the_hits_a_tenants_leases_hold_are_bounded_and_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpu_agent.engine import _leases

    monkeypatch.setattr(_leases, "TENANT_LEASED_HITS_MAX", 10)
    clock = FakeClock()
    config = dataclasses.replace(cfg(tmp_path), dram_bytes=64 * BS, tenants={"acme": 0, "other": 0})
    eng = Engine(config, clock=clock)
    try:
        keys = [chunk(i)[0] for i in range(4)]
        for i in range(4):
            eng.put_chunk("acme", *chunk(i))
            eng.put_chunk("other", *chunk(i))
        held = [eng.lookup("acme", keys).lease_id for _ in range(2)]  # 8 hits held
        with pytest.raises(LimitExceeded, match="hold 10 chunks"):
            eng.lookup("acme", keys)  # 12 > 10
        assert len(eng.lookup("acme", keys[:2]).hits) == 2  # 10: still within the share
        assert len(eng.lookup("other", keys).hits) == 4  # another tenant: its own share
        for lease_id in held:
            assert lease_id is not None
            eng.release("acme", lease_id)
        assert len(eng.lookup("acme", keys).hits) == 4  # released: room again
        clock.t += 3600.0  # and leases past their TTL give theirs back
        assert len(eng.lookup("acme", keys).hits) == 4
        assert len(eng.lookup("acme", keys).hits) == 4
    finally:
        eng.close()
