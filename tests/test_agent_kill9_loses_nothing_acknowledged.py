"""Agent-level kill -9 (issue 10): puts over the real control plane and NVMe/TCP, the agent
killed with SIGKILL 20 times at random moments, and every acknowledged NVMe-tier chunk read
back byte-exact at the end. DRAM is made too small for any chunk, so every acknowledged chunk
is on the NVMe tier (DRAM chunks are volatile by design, docs/ENGINE.md).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.testing import spawn_agent
from host_shim import KVClient

KILLS = 20
PUT_CHUNKS = 2  # chunks per put
RUN_S_MAX = 0.8  # each life: writes for a random 0.2-0.8 s, then SIGKILL
ENV = {"DPUKV_STORAGE_DRAM_BYTES": str(16 << 10)}  # no chunk fits DRAM: all go to NVMe


@pytest.mark.slow
def test_kill9_twenty_times_loses_no_acknowledged_chunk(tmp_path: Path) -> None:
    rng = random.Random(10)
    acked: list[int] = []  # seeds of acknowledged puts
    seed = 0
    for _life in range(KILLS):
        a = spawn_agent(tmp_path / "var", env=ENV)
        stop = threading.Event()

        def writer(
            a_url: str = a.control_url, token: str = a.token, stop: threading.Event = stop
        ) -> None:
            nonlocal seed
            try:
                with KVClient(a_url, "default", token, LAYOUT, SALT, timeout_s=5) as c:
                    while not stop.is_set():
                        seed += 1
                        s = seed
                        done = c.put(tokens_for(s, PUT_CHUNKS), chunks_for(s, PUT_CHUNKS))
                        if done == PUT_CHUNKS:
                            acked.append(s)  # acknowledged: both chunks committed
            except Exception:  # the agent died under it: what was acknowledged is recorded
                pass

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        time.sleep(rng.uniform(0.2, RUN_S_MAX))
        a.kill()  # SIGKILL, mid-put most of the time
        stop.set()
        t.join(30)
        assert not t.is_alive()
    assert len(acked) >= KILLS  # the test wrote something in most lives
    a = spawn_agent(tmp_path / "var", env=ENV)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, timeout_s=10) as c:
            lost = []
            for s in acked:
                out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(PUT_CHUNKS)]
                got = c.get(tokens_for(s, PUT_CHUNKS), out)
                want = chunks_for(s, PUT_CHUNKS)
                same = all(o.tobytes() == d.tobytes() for o, d in zip(out, want, strict=True))
                if got != PUT_CHUNKS or not same:
                    lost.append(s)
            assert lost == [], f"{len(lost)} of {len(acked)} acknowledged puts lost"
            stats = c.channel.call("stats")["stats"]
            assert stats["integrity_failures"] == 0
    finally:
        a.stop()
