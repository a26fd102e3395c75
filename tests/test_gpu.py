"""host_shim.gpu: which path a host gets and why, and the host-memory fallback (no GPU here)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra (torch)")
import torch

from host_shim import gpu
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout(
    model_id="t", dtype="float32", num_layers=2, num_kv_heads=1, head_dim=4, chunk_tokens=8
)
FULL = gpu.HostProbe(
    cuda=True, rdma_devices=("mlx5_0",), libibverbs=True, dmabuf_export=True, peermem=True
)


@pytest.mark.parametrize(
    ("changes", "kind", "reason"),
    [
        ({}, "gpudirect-dmabuf", "dma-buf export"),
        ({"dmabuf_export": False}, "gpudirect-peermem", "nvidia-peermem"),
        ({"dmabuf_export": False, "peermem": False}, "host", "modprobe nvidia-peermem"),
        ({"libibverbs": False}, "host", "libibverbs missing"),
        ({"rdma_devices": ()}, "host", "no RDMA device"),
        ({"cuda": False}, "host", "no CUDA device"),
    ],
)
def test_path_decision_table(changes: dict[str, object], kind: str, reason: str) -> None:
    probe = dataclasses.replace(FULL, **changes)  # type: ignore[arg-type]
    path = gpu.choose_path(probe)
    assert path.kind == kind and reason in path.reason
    assert path.gpudirect == (kind != "host")
    text = gpu.describe(path)
    assert reason in text
    if path.gpudirect:
        assert "stages chunks through pinned host memory" in text  # said, not hidden
        assert "NIXL data path registers GPU buffers as VRAM" in text  # the one registration


def test_probe_reads_sysfs(tmp_path: Path) -> None:
    (tmp_path / "class" / "infiniband" / "mlx5_1").mkdir(parents=True)
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir()
    (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    probe = gpu.probe_host(tmp_path)
    assert probe.rdma_devices == ("mlx5_0", "mlx5_1") and probe.peermem
    assert probe.cuda == torch.cuda.is_available()
    empty = gpu.probe_host(tmp_path / "nothing")
    assert empty.rdma_devices == () and not empty.peermem


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_this_host_gets_host_memory_and_says_why() -> None:
    path = gpu.gpu_path()
    assert path.kind == "host" and "no CUDA" in path.reason
    assert gpu.describe().startswith("host memory: no CUDA device")


class _Store:
    """A stand-in tier for the buffer test (the agent path is tested in test_integration_*)."""

    layout = LAYOUT

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = chunks

    def get(self, tokens: list[int], into: list[torch.Tensor]) -> int:
        for dst, src in zip(into, self.chunks, strict=False):
            dst.copy_(src)
        return min(len(into), len(self.chunks))


def test_host_fallback_loads_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    gpu._host_path_logged = False
    no_cuda = gpu.choose_path(
        gpu.HostProbe(
            cuda=False, rdma_devices=(), libibverbs=False, dmabuf_export=False, peermem=False
        )
    )
    chunks = [torch.randn(LAYOUT.chunk_shape) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="host_shim.gpu"):
        a = gpu.DeviceChunkBuffers(LAYOUT, 3, device="cpu", dtype=torch.float32, path=no_cuda)
        b = gpu.DeviceChunkBuffers(LAYOUT, 1, device="cpu", dtype=torch.float32, path=no_cuda)
    said = [r for r in caplog.records if "host memory" in r.getMessage()]
    assert len(said) == 1 and "no CUDA device" in said[0].getMessage()
    assert a.load(_Store(chunks), list(range(24))) == 2
    assert a.chunks[0].equal(chunks[0]) and a.chunks[1].equal(chunks[1])
    a.close()
    b.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_gpu_buffers_load_into_device_memory() -> None:  # pragma: no cover - needs a GPU
    chunks = [torch.randn(LAYOUT.chunk_shape) for _ in range(2)]
    bufs = gpu.DeviceChunkBuffers(LAYOUT, 2, device="cuda", dtype=torch.float32)
    assert bufs.load(_Store(chunks), list(range(16))) == 2
    assert bufs.chunks.cpu()[1].equal(chunks[1])
    bufs.close()


class _NixlStandIn(_Store):
    """A client on the NIXL path: records the buffers `get` was handed (the agent path with a
    real NIXL agent is tests/test_gpu_nixl.py)."""

    transport = "nixl"

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        super().__init__(chunks)
        self.handed: list[int] = []

    def get(self, tokens: list[int], into: list[torch.Tensor]) -> int:
        self.handed = [t.data_ptr() for t in into]
        return super().get(tokens, into)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_gpudirect_buffers_get_no_verbs_mr_of_their_own(
    caplog: pytest.LogCaptureFixture,
) -> None:  # pragma: no cover - needs a GPU
    """On a GPUDirect host the device buffers used to get a verbs MR (and a "registered for
    GPUDirect" log) that no transfer used; the only registration is the NIXL agent's, of the
    very tensors `load` hands the client."""
    path = gpu.choose_path(FULL)  # claims GPUDirect whether or not this host has a NIC
    chunks = [torch.randn(LAYOUT.chunk_shape, device="cuda") for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="host_shim.gpu"):
        bufs = gpu.DeviceChunkBuffers(LAYOUT, 2, device="cuda", dtype=torch.float32, path=path)
    assert not [r for r in caplog.records if "registered" in r.getMessage()]
    client = _NixlStandIn(chunks)
    assert bufs.load(client, list(range(16))) == 2
    assert client.handed == [t.data_ptr() for t in bufs.chunks.unbind(0)]  # no staging copy
    assert bufs.chunks[1].equal(chunks[1])
    bufs.close()
