"""Issue 10, findings 2 and 14, at the control server with a real engine.

2: a broken invariant (AssertionError) while handling a request was answered `internal` and the
   agent served on; now the connection is dropped and the server's fatal hook runs (the agent
   exits; the journal keeps every acknowledged commit).
14: corruption a client detected was deleted like any chunk (its extent reused) and counted
   nowhere; now the extent is quarantined and `stats` counts an integrity failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_control_server import TOKENS, serving

from dpu_agent.engine import Engine, EngineConfig
from host_shim.client import AgentUnreachable, ControlChannel, ControlError

BS = 4096


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(EngineConfig(data_dir=tmp_path, dram_bytes=16 * BS, nvme_bytes=256 * BS,
                            tenants={n: 0 for n in TOKENS}))  # fmt: skip
    try:
        yield e
    finally:
        e.close()


class BrokenStats:
    """An engine whose stats() trips an invariant, as a bug would."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stats(self, tenant: str | None = None) -> Any:
        raise AssertionError("lease count went negative")


def test_assertion_error_is_not_answered_and_reaches_the_fatal_hook(engine: Engine) -> None:
    seen: list[BaseException] = []
    with serving(engine, fatal=seen.append) as srv:
        srv.dispatcher.backend.engine = BrokenStats(engine)
        assert srv.tcp_address is not None
        ch = ControlChannel(f"tcp://127.0.0.1:{srv.tcp_address[1]}", "alpha", TOKENS["alpha"])
        ch.connect()
        with pytest.raises((AgentUnreachable, ConnectionError, OSError)):
            ch.call("stats")  # used to be answered `internal`, and the agent served on
        ch.close()
    assert len(seen) == 1 and isinstance(seen[0], AssertionError)


def test_client_reported_corruption_quarantines_the_extent(engine: Engine) -> None:
    key = b"q" * 16
    loc = engine.put_chunk("alpha", key, bytes(range(256)) * 64)
    with serving(engine) as srv:
        assert srv.tcp_address is not None
        ch = ControlChannel(f"tcp://127.0.0.1:{srv.tcp_address[1]}", "alpha", TOKENS["alpha"])
        ch.connect()
        ch.call("delete", key=key, corrupt=True)  # what KVClient sends on a checksum failure
        stats = ch.call("stats")["stats"]
        with pytest.raises(ControlError, match="not_found"):
            ch.call("delete", key=key, corrupt=True)  # gone: nothing more to report
        ch.close()
    assert stats["integrity_failures"] == 1
    tier = "dram" if loc.nsid == 1 else "nvme"
    assert stats["tiers"][tier]["quarantined_bytes"] == loc.block_count * BS
    for i in range(40):  # fill the tiers: the quarantined extent is never handed out again
        got = engine.put_chunk("alpha", i.to_bytes(16, "big"), bytes([i + 1]) * (4 * BS))
        overlap = got.lba < loc.lba + loc.block_count and loc.lba < got.lba + got.block_count
        assert not (got.nsid == loc.nsid and overlap)
        engine.tick()
