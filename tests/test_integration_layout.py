"""Layout conversions of the engine integrations on CPU tensors (byte-exact round trips), the
vLLM and LMCache pieces that need neither engine, and their data path against a real agent."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra (torch)")
import torch

from host_shim.integrations.layout import (
    PAGED_KINDS,
    PagedLayout,
    chunk_block_ids,
    chunks_to_per_layer,
    gather_chunk,
    per_layer_to_chunks,
    scatter_chunk,
)
from host_shim.integrations.lmcache import (
    KeyedChunks,
    pack_object,
    parse_dpukv_url,
    tier_key,
    unpack_object,
)
from host_shim.integrations.vllm import (
    ConnectorSettings,
    ReqLoad,
    ReqStore,
    load_request,
    matched_tokens,
    save_request,
    storable_chunks,
)
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout(
    model_id="test/tiny", dtype="float16", num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=32
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN payloads and -0.0 compare exactly too."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _random(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(shape) & 0xFFFF)
    raw = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
    return raw.to(torch.int16).view(dtype)  # every bit pattern, NaNs and infinities included


def test_per_layer_round_trip_is_byte_exact() -> None:
    tokens = 3 * LAYOUT.chunk_tokens + 5  # a partial tail: not a chunk
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    keys = [_random((*shape[:-1], shape[-1] + i))[..., : LAYOUT.head_dim] for i in range(3)]
    values = [_random(shape) for _ in range(3)]
    chunks = per_layer_to_chunks(keys, values, LAYOUT)
    assert len(chunks) == 3 and all(c.shape == LAYOUT.chunk_shape for c in chunks)
    back = chunks_to_per_layer(torch.stack(chunks), LAYOUT)
    full = 3 * LAYOUT.chunk_tokens
    for layer, (k, v) in enumerate(back):
        assert _bits(k).equal(_bits(keys[layer][..., :full, :]))
        assert _bits(v).equal(_bits(values[layer][..., :full, :]))


def test_per_layer_chunk_holds_k_then_v_of_its_tokens() -> None:
    n = LAYOUT.chunk_tokens
    shape = (1, LAYOUT.num_kv_heads, 2 * n, LAYOUT.head_dim)
    keys = [torch.full(shape, float(layer)) for layer in range(3)]
    values = [torch.full(shape, -float(layer)) for layer in range(3)]
    for k in keys:
        k[0, :, n:] += 100  # chunk 1's tokens
    (second,) = per_layer_to_chunks(keys, values, LAYOUT, first=1, count=1)
    assert second[2, 0].eq(102).all() and second[2, 1].eq(-2).all()


@pytest.mark.parametrize("kind", PAGED_KINDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_blocks_chunk_round_trip_is_byte_exact(kind: str, block_size: int) -> None:
    paged = PagedLayout(kind=kind, block_size=block_size)  # type: ignore[arg-type]
    num_blocks = 20
    layers = [
        _random(paged.shape(num_blocks, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)
    ]
    table = [7, 3, 19, 0, 11, 5, 2, 13]  # a request's blocks, scattered over the pool
    per = LAYOUT.chunk_tokens // block_size
    chunks = [gather_chunk(layers, paged, table, i, LAYOUT) for i in range(len(table) // per)]
    # Token t of the request lives in block table[t // bs] at offset t % bs.
    t = LAYOUT.chunk_tokens + 3
    std = paged.standard(layers[1])
    assert _bits(chunks[1][1, 0, :, 3]).equal(_bits(std[0, table[t // block_size], t % block_size]))
    # Into other blocks of fresh layers, and back out: the same bytes.
    fresh = [torch.zeros_like(x) for x in layers]
    other = [1, 4, 6, 8, 9, 10, 12, 14]
    for i, chunk in enumerate(chunks):
        scatter_chunk(chunk, fresh, paged, other, i, LAYOUT)
    for i, chunk in enumerate(chunks):
        assert _bits(gather_chunk(fresh, paged, other, i, LAYOUT)).equal(_bits(chunk))
    untouched = sorted(set(range(num_blocks)) - set(other[: len(chunks) * per]))
    for x in fresh:
        assert paged.standard(x)[:, untouched].eq(0).all()


def test_chunk_must_cover_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's block_size"):
        chunk_block_ids(list(range(10)), 0, chunk_tokens=24, block_size=16)
    assert chunk_block_ids([5, 6, 7, 8], 1, chunk_tokens=32, block_size=16) == [7, 8]


def test_vllm_matched_and_storable_tokens() -> None:
    assert matched_tokens(4, prompt_tokens=1000, num_computed_tokens=0, chunk_tokens=256) == 768
    # all of a 512-token prompt cached: one token must still be computed -> one chunk less
    assert matched_tokens(2, prompt_tokens=512, num_computed_tokens=0, chunk_tokens=256) == 256
    assert matched_tokens(3, prompt_tokens=1000, num_computed_tokens=512, chunk_tokens=256) == 256
    assert matched_tokens(1, prompt_tokens=1000, num_computed_tokens=512, chunk_tokens=256) == 0
    assert storable_chunks(600, 1000, 256) == 2 and storable_chunks(2000, 1000, 256) == 3


def test_vllm_settings_read_secrets(tmp_path: object) -> None:
    import pathlib

    d = pathlib.Path(str(tmp_path))
    (d / "t").write_text("tok\n")
    (d / "s").write_text("00" * 16 + "\n")
    s = ConnectorSettings.from_extra_config(
        {
            "control": "tcp://h:1",
            "tenant": "a",
            "token_file": str(d / "t"),
            "salt_file": str(d / "s"),
        }
    )
    assert s.token == "tok" and s.salt == bytes(16) and s.chunk_tokens == 256
    with pytest.raises(ValueError, match=r"needs '(salt|token)' or"):
        ConnectorSettings.from_extra_config({"control": "tcp://h:1", "tenant": "a"})


def test_vllm_module_imports_without_vllm() -> None:
    import host_shim.integrations.vllm as mod

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ModuleNotFoundError, match="vllm"):
            _ = mod.DpuKVConnector
    assert "vllm" not in sys.modules or importlib.util.find_spec("vllm") is not None


def test_lmcache_object_pack_round_trip_and_keys() -> None:
    payload = bytes(range(256)) * 3
    data = pack_object([2, 4, 256, 64], "bfloat16", 1, payload)
    shape, dtype, fmt, back = unpack_object(data)
    assert (shape, dtype, fmt, bytes(back)) == ([2, 4, 256, 64], "bfloat16", 1, payload)
    with pytest.raises(ValueError, match="does not match"):
        unpack_object(data[:-1])
    with pytest.raises(ValueError, match="no header"):
        unpack_object(b"\x01")
    a, b = tier_key(b"s" * 16, "model@1@0@abc"), tier_key(b"t" * 16, "model@1@0@abc")
    assert len(a) == 16 and a != b  # salted per tenant
    assert parse_dpukv_url("dpukv://10.0.0.2:7400/acme") == ("tcp://10.0.0.2:7400", "acme")
    with pytest.raises(ValueError, match="dpukv://HOST:PORT/TENANT"):
        parse_dpukv_url("dpukv://10.0.0.2/acme")


def test_lmcache_module_imports_without_lmcache() -> None:
    import host_shim.integrations.lmcache as mod

    if importlib.util.find_spec("lmcache") is None:
        with pytest.raises(ModuleNotFoundError, match="lmcache"):
            _ = mod.DpuKVConnectorAdapter


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installable "
    "here (CUDA wheels); the live connector test needs vLLM and a GPU",
)
def test_vllm_connector_live() -> None:  # pragma: no cover - needs vLLM and a GPU
    pytest.skip("a live vLLM engine with this connector needs a GPU; none on this machine")


@pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None,
    reason="LMCache is not installed (it needs CUDA builds of torch)",
)
def test_lmcache_connector_live() -> None:  # pragma: no cover - needs LMCache
    pytest.skip("a live LMCache engine needs vLLM and a GPU; none on this machine")


# --- against a real agent --------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from dpu_agent.service import spawn_agent

    proc = spawn_agent(tmp_path_factory.mktemp("agent"))
    yield proc
    proc.stop()


def test_vllm_save_then_load_through_the_agent(agent: Any) -> None:
    from host_shim.client import KVClient

    paged = PagedLayout(kind="flash_attn", block_size=16)
    layers = [_random(paged.shape(24, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)]
    tokens = tuple(range(1000, 1000 + 3 * LAYOUT.chunk_tokens + 7))
    table = (*tuple(range(0, 24, 3))[:6], 1, 2)  # 3 chunks of 2 blocks each, and spare blocks
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        store = ReqStore(req_id="a", token_ids=tokens, block_ids=table, chunk_count=3)
        assert save_request(kv, layers, paged, LAYOUT, store) == 3
        fresh = [torch.zeros_like(x) for x in layers]
        other = (5, 8, 11, 14, 17, 20, 23, 4)
        hits = kv.lookup(list(tokens))
        assert matched_tokens(hits, len(tokens), 32, LAYOUT.chunk_tokens) == 64
        load = ReqLoad(req_id="b", token_ids=tokens, block_ids=other, first_chunk=1, chunk_count=2)
        assert load_request(kv, fresh, paged, LAYOUT, load) == 2
    for i in (1, 2):
        want = gather_chunk(layers, paged, table, i, LAYOUT)
        assert _bits(gather_chunk(fresh, paged, other, i, LAYOUT)).equal(_bits(want))
    assert paged.standard(fresh[0])[:, list(other[:2])].eq(0).all()  # chunk 0: vLLM's own


def test_lmcache_objects_through_the_agent(agent: Any) -> None:
    from host_shim.client import KVClient

    salt = os.urandom(32)
    layout = ChunkLayout(
        model_id="lmcache", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1
    )
    with KVClient(agent.control_url, "default", agent.token, layout, salt) as kv:
        objects = KeyedChunks(kv)
        key = tier_key(salt, "SmolLM2@1@0@deadbeef@float32")
        data = pack_object([2, 30, 256, 192], "float32", 1, os.urandom(10_000))
        assert not objects.exists(key) and objects.read(key) is None
        assert objects.write(key, data)
        assert objects.exists(key)
        assert objects.read(key) == data
