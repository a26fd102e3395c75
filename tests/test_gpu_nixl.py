"""The GPU path: with the NIXL data path, CUDA KV tensors go to the shim as they are (NIXL
registers them as VRAM; the agent writes into them), no staging through host memory. The live
tests need a CUDA GPU and skip without one; `staging_device` (the decision) runs everywhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from dpu_agent.testing import AgentProcess, spawn_agent  # noqa: E402
from host_shim import KVClient  # noqa: E402
from host_shim.gpu import DeviceChunkBuffers, choose_path, probe_host, staging_device  # noqa: E402
from host_shim.transport import buffer_desc, nixl_status  # noqa: E402
from kvproto.keys import ChunkLayout  # noqa: E402

LAYOUT = ChunkLayout("gpu-nixl", "bfloat16", 2, 2, 64, chunk_tokens=16)
SALT = b"gpu-nixl-salt-0123456"
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine (torch.cuda)"
)
needs_nixl = pytest.mark.skipif(not nixl_status()["available"], reason="NIXL not installed")


@pytest.mark.parametrize(
    ("transport", "device", "expected"),
    [("nixl", "cuda:0", "cuda:0"), ("nvme-tcp", "cuda:0", "cpu"), ("", "cuda:0", "cpu"),
     ("nixl", "cpu", "cpu")],
)  # fmt: skip
def test_staging_device(transport: str, device: str, expected: str) -> None:
    client = SimpleNamespace(transport=transport)
    assert staging_device(client, device) == torch.device(expected)


@needs_gpu
def test_cuda_tensor_descriptor_is_vram_of_its_storage() -> None:
    pool = torch.zeros((4, *LAYOUT.chunk_shape), dtype=torch.bfloat16, device="cuda")
    d = buffer_desc(pool[2], LAYOUT.chunk_bytes, writable=True)
    assert d.mem == "VRAM" and d.addr == pool[2].data_ptr()
    assert d.region_addr == pool.untyped_storage().data_ptr()


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var", env={"UCX_TLS": "tcp,cuda_copy,cuda_ipc"})
    yield a
    a.stop()


@needs_gpu
@needs_nixl
def test_nixl_get_and_put_cuda_tensors_without_staging(agent: AgentProcess) -> None:
    src = torch.randn((3, *LAYOUT.chunk_shape), device="cuda").to(torch.bfloat16)
    tokens = list(range(3 * LAYOUT.chunk_tokens))
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT, transport="nixl") as c:
        assert c.put(tokens, list(src.unbind(0))) == 3
        assert c.transport == "nixl"
        bufs = DeviceChunkBuffers(LAYOUT, 3, device="cuda", dtype=torch.bfloat16,
                                  path=choose_path(probe_host()))  # fmt: skip
        assert bufs.load(c, tokens) == 3
    assert torch.equal(bufs.chunks, src)
