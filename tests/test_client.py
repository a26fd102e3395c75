"""KVClient: caller buffers of every kind (numpy, bytearray, torch CPU tensors incl. bfloat16),
URLs, prefetch, and a corrupted chunk ending the prefix, against a real agent child."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import byte_view, parse_control_url
from host_shim.nvme import NvmeStatusError
from kvproto.checksum import chunk_checksum
from kvproto.keys import ChunkLayout
from kvproto.nvme import Status

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


def where(c: KVClient, tokens: np.ndarray, i: int) -> tuple[int, int]:
    """(nsid, lba) of the i-th chunk of `tokens` (a probe: no lease taken)."""
    hits = c.channel.call("lookup", keys=c.keys(tokens), lease=False)["hits"]
    _, nsid, lba, _, _, _ = hits[i]
    return int(nsid), int(lba)


def data_path(c: KVClient) -> Any:
    """The client's own NVMe/TCP controller (to send raw commands as its host)."""
    nvme = c.node._nvme if c.node is not None else None
    assert nvme is not None
    return nvme


def test_corrupted_chunk_ends_the_prefix(tmp_path: Path) -> None:
    """A chunk whose stored bytes no longer match its checksum is a miss, never wrong KV."""
    # a DRAM tier of one block: the 4-block chunks go to the NVMe tier's file
    a = spawn_agent(tmp_path / "var", env={"DPUKV_STORAGE_DRAM_BYTES": "4096"})
    try:
        tokens = np.arange(3 * LAYOUT.chunk_tokens, dtype=np.uint32) + 5000
        chunks = [np.full(LAYOUT.chunk_shape, i + 1, np.uint16) for i in range(3)]
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT) as c:
            assert c.put(tokens, chunks) == 3
            nsid, lba = where(c, tokens, 1)
            assert nsid == 2, (nsid, lba)
            # a bad sector under chunk 1: its ciphertext changed behind the engine's back
            with open(tmp_path / "var" / "nvme" / "default" / "nvme.img", "r+b") as f:
                f.seek(lba * 4096)
                f.write(bytes(4096))
            out = [np.empty(LAYOUT.chunk_shape, np.uint16) for _ in range(3)]
            assert c.get(tokens, out) == 1
            assert np.array_equal(out[0], chunks[0])
            assert c.lookup(tokens) == 1  # the bad chunk was dropped, not served again
    finally:
        a.stop()


def test_a_host_writes_only_inside_its_open_reservations(agent: AgentProcess) -> None:
    """Found by an attack pass: a tenant's host wrote any block of its namespaces over
    NVMe/TCP without reserving (a 1 MiB quota, 64 MiB written; the sparse file and the disk
    under every tenant's filled) and could overwrite committed chunks. Now a write, Write
    Zeroes or deallocate outside the tenant's open reservations is refused: Access Denied."""
    tokens = np.arange(2 * LAYOUT.chunk_tokens, dtype=np.uint32) + 7000
    chunks = [np.full(LAYOUT.chunk_shape, i + 3, np.uint16) for i in range(2)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, chunks) == 2
        nsid, lba = where(c, tokens, 1)
        nvme = data_path(c)
        for target in ((nsid, lba), (1, 5000), (2, 100_000)):  # a chunk's block, free blocks
            with pytest.raises(NvmeStatusError) as e:
                nvme.write(*target, bytes(4096))
            assert e.value.code == Status.ACCESS_DENIED
        res = c.channel.call("reserve", key=bytes(range(16)), length=4096)
        nvme.write(res["nsid"], res["lba"], bytes(4096))  # inside its reservation: written
        with pytest.raises(NvmeStatusError):  # ...and not one block past it
            nvme.write(res["nsid"], res["lba"] + 1, bytes(4096))
        c.channel.call("abort", reservation_id=res["reservation_id"])
        with pytest.raises(NvmeStatusError):  # nor after it ended
            nvme.write(res["nsid"], res["lba"], bytes(4096))
        out = [np.empty(LAYOUT.chunk_shape, np.uint16) for _ in range(2)]
        assert c.get(tokens, out) == 2 and np.array_equal(out[1], chunks[1])


def test_key_level_calls_round_trip_byte_exact(agent: AgentProcess) -> None:
    """put_keys/get_keys are what put/get run on: the same chunks either way, bit for bit."""
    rng = np.random.default_rng(7)
    n = LAYOUT.chunk_bytes
    src = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(3)]
    tokens = np.arange(3 * LAYOUT.chunk_tokens, dtype=np.uint32) + 9000
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        keys = c.keys(tokens)
        assert c.lookup_keys(keys) == 0 and c.lookup_lengths(keys) == []
        assert c.put_keys(keys, src) == 3
        assert c.lookup_keys(keys) == c.lookup(tokens) == 3
        assert c.lookup_lengths(keys) == [n, n, n]
        by_key = [bytearray(n) for _ in range(3)]
        assert c.get_keys(keys, by_key) == 3
        by_token = [np.empty(n, np.uint8) for _ in range(3)]
        assert c.get(tokens, by_token) == 3
        for want, a, b in zip(src, by_key, by_token, strict=True):
            assert bytes(a) == want.tobytes() == b.tobytes()
        assert c.get_keys(keys, by_key[:2]) == 2  # as get(): no more than the buffers given

        own = [bytes([i]) * 16 for i in (1, 2)]  # keys the engine named itself, explicit parents
        blobs = [rng.bytes(10_000), rng.bytes(10_000)]
        assert c.put_keys(own, blobs, [keys[0], own[0]], chunk_bytes=10_000) == 2
        out = [bytearray(10_000), bytearray(10_000)]
        assert c.get_keys(own, out, chunk_bytes=10_000) == 2
        assert [bytes(b) for b in out] == blobs
        assert c.get_keys(own, [bytearray(n), bytearray(n)]) == 0  # another length: a miss


def test_key_level_calls_refuse_wrong_length_keys(agent: AgentProcess) -> None:
    good, short = bytes(16), b"\x01" * 15
    chunk = bytearray(LAYOUT.chunk_bytes)
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        with pytest.raises(ValueError, match=r"keys\[1\] .* not 16 bytes"):
            c.lookup_keys([good, short])
        with pytest.raises(ValueError, match="not 16 bytes"):
            c.get_keys([short], [chunk])
        with pytest.raises(ValueError, match="not 16 bytes"):
            c.put_keys([good.hex()], [chunk])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"parents\[0\] .* not 16 bytes"):
            c.put_keys([good], [chunk], [short])
        with pytest.raises(ValueError, match="2 parents for 1 keys"):
            c.put_keys([good], [chunk], [None, None])


def test_key_level_calls_lost_agent_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    keys = [bytes(16)]
    chunk = bytearray(LAYOUT.chunk_bytes)
    with KVClient("tcp://127.0.0.1:1", "default", "t", LAYOUT, SALT, timeout_s=0.5) as c:
        with caplog.at_level("WARNING", logger="host_shim.client"):
            assert c.lookup_keys(keys) == 0
            assert c.lookup_lengths(keys) == []
            assert c.get_keys(keys, [chunk]) == 0
            assert c.put_keys(keys, [chunk]) == 0
    assert sum("agent lost" in r.getMessage() for r in caplog.records) == 1


def test_a_write_whose_data_comes_after_its_reservation_ended_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write gate was checked when the Write command came; its data comes after the R2T,
    up to R2T_TIMEOUT_S later. A reservation committed or aborted meanwhile: the data landed
    on the committed chunk, or on freed blocks the next reservation got (a re-attack pass).
    The gate is asked again when the data is in."""
    from host_shim.nvme._queue import QueuePairSocket

    # a DRAM tier of one block: the reservations are the NVMe tier's (data copied, not in place)
    a = spawn_agent(tmp_path / "var", env={"DPUKV_STORAGE_DRAM_BYTES": "4096"})
    hooks: list[Any] = []
    real = QueuePairSocket._r2t

    def on_r2t(self: Any, ev: Any) -> Any:  # between the R2T and the data it asks for
        if hooks:
            hooks.pop()()
        return real(self, ev)

    monkeypatch.setattr(QueuePairSocket, "_r2t", on_r2t)
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT) as c:
            assert c.put(np.arange(16, dtype=np.uint32) + 1, [np.ones(LAYOUT.chunk_shape,
                                                                     np.uint16)]) == 1  # fmt: skip
            nvme = data_path(c)
            key, blocks = bytes(range(16)), 4
            res = c.channel.call("reserve", key=key, length=blocks * 4096)
            assert res["nsid"] == 2, res
            first = os.urandom(blocks * 4096)
            nvme.write(res["nsid"], res["lba"], first)  # inside the open reservation: written
            hooks.append(lambda: c.channel.call("commit", reservation_id=res["reservation_id"],
                                                checksum=chunk_checksum(key, first)))  # fmt: skip
            with pytest.raises(NvmeStatusError) as e:
                nvme.write(res["nsid"], res["lba"], bytes(blocks * 4096))
            assert e.value.code == Status.ACCESS_DENIED
            back = bytearray(blocks * 4096)
            nvme.read(res["nsid"], res["lba"], back)
            assert bytes(back) == first  # the committed chunk kept its bytes
            res = c.channel.call("reserve", key=bytes(16), length=blocks * 4096)
            hooks.append(lambda: c.channel.call("abort", reservation_id=res["reservation_id"]))
            with pytest.raises(NvmeStatusError) as e:
                nvme.write(res["nsid"], res["lba"], first)
            assert e.value.code == Status.ACCESS_DENIED
    finally:
        a.stop()
