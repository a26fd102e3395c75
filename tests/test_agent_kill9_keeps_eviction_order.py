"""A real agent killed with SIGKILL keeps its eviction order: the engine saves it every
`storage.policy_order_save_s` from its tick, and the start after the kill hands the policy
the order of the last save (`previous_stop: unclean`). Before, the order was saved only at a
clean close, so after a crash every recovered chunk went to the cold list and the chunks the
policy had protected were evicted first. What the order does to evictions is tested on the
engine (tests/test_engine_restart.py); this is the agent's wiring, for real.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.engine._restart_order import POLICY_ORDER
from dpu_agent.testing import spawn_agent
from host_shim import KVClient

ENV = {
    "DPUKV_STORAGE_DRAM_BYTES": str(16 << 10),  # no chunk fits DRAM: all go to NVMe
    "DPUKV_STORAGE_POLICY_ORDER_SAVE_S": "1",
}
PREFIXES = 6
CHUNKS = 3


def _events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            out.append(event)
    return out


def _get_all(c: KVClient, seed: int) -> bool:
    out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
    got = c.get(tokens_for(seed, CHUNKS), out)
    want = chunks_for(seed, CHUNKS)
    return got == CHUNKS and all(o.tobytes() == w.tobytes() for o, w in zip(out, want, strict=True))


def test_after_kill9_the_next_start_takes_over_the_saved_order(tmp_path: Path) -> None:
    data = tmp_path / "var"
    order = data / "journal" / POLICY_ORDER
    a = spawn_agent(data, env=ENV)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            for s in range(PREFIXES):
                assert c.put(tokens_for(s, CHUNKS), chunks_for(s, CHUNKS)) == CHUNKS
            for _ in range(3):
                assert _get_all(c, 0)  # one prefix used again and again
        deadline = time.monotonic() + 30
        while not order.exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the tick saves it within policy_order_save_s
        assert order.exists(), "no order saved while the agent ran"
        time.sleep(1.5)  # a save after the last use
    finally:
        a.kill()  # SIGKILL: no close(), no clean-stop marker
    a = spawn_agent(data, env=ENV)
    try:
        adopted = _events(data / "agent.log", "engine.policy_order_adopted")
        assert adopted, "the start after the kill adopted no saved order"
        assert adopted[-1]["previous_stop"] == "unclean"
        assert adopted[-1]["items"] == PREFIXES * CHUNKS
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            assert all(_get_all(c, s) for s in range(PREFIXES))
    finally:
        assert a.stop() == 0
