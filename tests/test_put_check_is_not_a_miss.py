"""A put's own check of what the agent already holds is not a read: it counts no misses.

Before, `KVClient.put` asked `lookup` (lease=False) which of its keys were stored, and the agent
counted every key it was about to write as a miss: writes lowered `kvtier_hit_ratio` and the
tenant's `misses`. A real agent, its /metrics and its stats.
"""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np

from dpu_agent.testing import spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("put-check-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"put-check-salt-0123456"


def _ratio(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^kvtier_hit_ratio\{tenant="default"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_puts_count_no_misses_and_reads_still_count(tmp_path) -> None:
    a = spawn_agent(tmp_path / "var")
    try:
        url = json.loads((a.data_dir / "agent.json").read_text())["metrics"]
        chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(4)]
        tokens = list(range(4 * LAYOUT.chunk_tokens))
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT) as c:
            assert c.put(tokens, chunks) == 4
            assert c.put(tokens, chunks) == 4  # all already there: checked, not re-sent
            stats = c.stats()["stats"]
            assert (stats["hits"], stats["misses"]) == (0, 0), stats
            assert c.lookup(tokens) == 4  # a read: 4 hits
            assert c.lookup([t + 10_000 for t in tokens]) == 0  # a read of other tokens: misses
            stats = c.stats()["stats"]
            assert (stats["hits"], stats["misses"]) == (4, 4), stats
        assert _ratio(url) == 0.5
    finally:
        a.stop()
