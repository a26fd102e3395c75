"""KVClient: caller buffers of every kind (numpy, bytearray, torch CPU tensors incl. bfloat16),
URLs, prefetch, and a corrupted chunk ending the prefix, against a real agent child."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.service import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import byte_view, parse_control_url
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("client-model", "bfloat16", 2, 2, 64, chunk_tokens=16)  # 16 KiB
SALT = b"client-test-salt-0123"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("client") / "var")
    yield a
    a.stop()


def test_parse_control_url() -> None:
    assert parse_control_url("tcp://127.0.0.1:7400") == ("tcp", ("127.0.0.1", 7400))
    assert parse_control_url("unix:///run/dpukv.sock") == ("unix", "/run/dpukv.sock")
    for bad in ("http://x:1", "tcp://nohost", "unix://"):
        with pytest.raises(ValueError):
            parse_control_url(bad)


def test_byte_view_accepts_buffers_and_refuses_wrong_ones() -> None:
    n = LAYOUT.chunk_bytes
    assert byte_view(np.zeros(LAYOUT.chunk_shape, np.float16), n, writable=True).nbytes == n
    assert byte_view(bytearray(n), n, writable=True).nbytes == n
    with pytest.raises(ValueError, match="read-only"):
        byte_view(bytes(n), n, writable=True)
    with pytest.raises(ValueError, match="bytes"):
        byte_view(bytearray(n - 1), n, writable=False)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(np.zeros((2, n), np.uint8)[:, ::2], n, writable=False)


def test_torch_tensors_bfloat16_round_trip(agent: AgentProcess) -> None:
    torch = pytest.importorskip("torch")
    src = [torch.randn(LAYOUT.chunk_shape, dtype=torch.bfloat16) for _ in range(3)]
    dst = [torch.empty(LAYOUT.chunk_shape, dtype=torch.bfloat16) for _ in range(3)]
    tokens = list(range(3 * LAYOUT.chunk_tokens))
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, src) == 3
        assert c.get(tokens, dst) == 3
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_prefetch_is_awaitable(agent: AgentProcess) -> None:
    tokens = np.arange(2 * LAYOUT.chunk_tokens, dtype=np.uint32) + 777
    chunks = [np.full(LAYOUT.chunk_shape, 7, np.uint16) for _ in range(2)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, chunks) == 2

        async def run() -> int:
            return await c.prefetch(tokens)

        assert asyncio.run(run()) == 2


def test_corrupted_chunk_ends_the_prefix(agent: AgentProcess, tmp_path: Path) -> None:
    """A chunk whose stored bytes no longer match its checksum is a miss, never wrong KV."""
    tokens = np.arange(3 * LAYOUT.chunk_tokens, dtype=np.uint32) + 5000
    chunks = [np.full(LAYOUT.chunk_shape, i + 1, np.uint16) for i in range(3)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, chunks) == 3
        hits = c.channel.call("lookup", keys=c.keys(tokens), lease=False)["hits"]
        _, nsid, lba, _, _, _ = hits[1]
        nvme = c._nvme  # the client's own data path: overwrite chunk 1 behind the engine's back
        assert nvme is not None
        nvme.write(nsid, lba, bytes(4096))
        out = [np.empty(LAYOUT.chunk_shape, np.uint16) for _ in range(3)]
        assert c.get(tokens, out) == 1
        assert np.array_equal(out[0], chunks[0])
        assert c.lookup(tokens) == 1  # the bad chunk was dropped, not served again
