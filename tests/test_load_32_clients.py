"""32 concurrent clients against one real agent for a few seconds: no errors, every get
byte-exact, the agent's RSS bounded. Bounded in time (LOAD_S) and in operations per client."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np

from dpu_agent.testing import rss_bytes, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("load-model", "float16", 4, 2, 64, chunk_tokens=32)  # 64 KiB chunks
SALT = b"load-test-salt-0123"
CLIENTS = 32
LOAD_S = 4.0
OPS_PER_CLIENT_MAX = 2000
PROMPTS = 6  # per client, plus SHARED prompts every client uses
SHARED = 2
CHUNKS = 4
RSS_BYTES_MAX = 1 << 30  # DRAM tier (256 MiB) + index + 32 clients' queues and buffers


def prompt_tokens(prompt: int) -> np.ndarray:
    return np.arange(CHUNKS * LAYOUT.chunk_tokens, dtype=np.uint32) + prompt * 1_000_000


def prompt_chunks(prompt: int) -> list[np.ndarray]:
    rng = np.random.default_rng(prompt)
    return [
        rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
        for _ in range(CHUNKS)
    ]


def worker(url: str, token: str, cid: int, deadline: float, errors: list[str],
           counts: list[int]) -> None:  # fmt: skip
    prompts = [*(1000 + cid * PROMPTS + p for p in range(PROMPTS)), *range(SHARED)]
    data = {p: prompt_chunks(p) for p in prompts}
    out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
    rng = np.random.default_rng(cid)
    ops = 0
    try:
        with KVClient(url, "default", token, LAYOUT, SALT, io_queues=1) as c:
            while time.monotonic() < deadline and ops < OPS_PER_CLIENT_MAX:
                p = prompts[int(rng.integers(len(prompts)))]
                op = int(rng.integers(3))
                if op == 0:
                    if c.put(prompt_tokens(p), data[p]) != CHUNKS:
                        errors.append(f"client {cid}: put of prompt {p} incomplete")
                elif op == 1:
                    n = c.get(prompt_tokens(p), out)
                    for i in range(n):
                        if out[i].tobytes() != data[p][i].tobytes():
                            errors.append(f"client {cid}: prompt {p} chunk {i} differs")
                else:
                    c.lookup(prompt_tokens(p))
                ops += 1
    except Exception as e:  # any exception is a failure of the test
        errors.append(f"client {cid}: {type(e).__name__}: {e}")
    counts[cid] = ops


def test_32_clients_no_errors_byte_exact_bounded_rss(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path / "var")
    try:
        rss_start = rss_bytes(agent.proc.pid)
        errors: list[str] = []
        counts = [0] * CLIENTS
        deadline = time.monotonic() + LOAD_S
        threads = [
            threading.Thread(
                target=worker, args=(agent.control_url, agent.token, i, deadline, errors, counts)
            )
            for i in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(LOAD_S + 60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        rss_end = rss_bytes(agent.proc.pid)
        assert errors == [], errors[:10]
        assert all(n > 0 for n in counts), counts
        assert rss_end < RSS_BYTES_MAX, (rss_start, rss_end)
        print(f"\n{sum(counts)} ops by {CLIENTS} clients in {LOAD_S} s; "
              f"agent RSS {rss_start >> 20} -> {rss_end >> 20} MiB")  # fmt: skip
    finally:
        assert agent.stop(signal.SIGTERM) == 0
