"""Layout conversions of the engine integrations on CPU tensors (byte-exact round trips), the
vLLM and LMCache pieces that need neither engine, and their data path against a real agent."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
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
    gather_chunks,
    per_layer_to_chunks,
    scatter_chunk,
    scatter_chunks,
)
from host_shim.integrations.lmcache import (
    KeyedChunks,
    agent_address,
    object_shape,
    parse_dpukv_url,
    tier_key,
)
from host_shim.integrations.vllm import (
    ConnectorSettings,
    ReqLoad,
    ReqStore,
    failed_block_ids,
    load_request,
    matched_tokens,
    paged_kind_for,
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
    std = paged.standard(layers[1])  # [2, H, blocks, bs, D]
    want = std[0, :, table[t // block_size], t % block_size]
    assert _bits(chunks[1][1, 0, :, 3]).equal(_bits(want))
    # All chunks in one gather: the same bytes as one at a time.
    together = gather_chunks(layers, paged, table, 0, len(chunks), LAYOUT)
    assert _bits(together).equal(_bits(torch.stack(chunks)))
    # Into other blocks of fresh layers, and back out: the same bytes.
    fresh = [torch.zeros_like(x) for x in layers]
    other = [1, 4, 6, 8, 9, 10, 12, 14]
    for i, chunk in enumerate(chunks):
        scatter_chunk(chunk, fresh, paged, other, i, LAYOUT)
    for i, chunk in enumerate(chunks):
        assert _bits(gather_chunk(fresh, paged, other, i, LAYOUT)).equal(_bits(chunk))
    untouched = sorted(set(range(num_blocks)) - set(other[: len(chunks) * per]))
    for x in fresh:
        assert paged.standard(x)[:, :, untouched].eq(0).all()


def _token_kv(layout: ChunkLayout, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[tokens, H, D]`` of one layer, every value naming (K/V, token, head, dim)."""
    t, h, d = torch.meshgrid(
        torch.arange(tokens), torch.arange(layout.num_kv_heads), torch.arange(layout.head_dim),
        indexing="ij",
    )  # fmt: skip
    k = (t * 1000 + h * 100 + d).float()
    return k, -k - 1


def test_vllm_cpu_layout_keeps_k_block_then_v_block() -> None:
    """vLLM 0.32's CPU backend: [B, H, N, 2D] holding, per (block, head), N key rows then N
    value rows (cpu_attn.py views it as [B, H, 2N, D] and splits dim 2). Written here the way
    that backend writes it; a layout that took the last dim as (K, V) per token fails."""
    layout = ChunkLayout(
        model_id="t", dtype="float32", num_layers=1, num_kv_heads=3, head_dim=8, chunk_tokens=64
    )
    bs, blocks = 32, 6
    kv = torch.zeros((blocks, 3, bs, 16))
    key_cache, value_cache = kv.view(blocks, 3, 2 * bs, 8).chunk(2, dim=2)
    k, v = _token_kv(layout, 128)
    table = [4, 1, 5, 0]
    for tok in range(128):
        block, off = table[tok // bs], tok % bs
        key_cache[block, :, off] = k[tok]
        value_cache[block, :, off] = v[tok]
    paged = PagedLayout(kind="cpu", block_size=bs)
    paged.check(kv, 3, 8)
    chunks = gather_chunks([kv], paged, table, 0, 2, layout)
    assert chunks[1, 0, 0].equal(k[64:].permute(1, 0, 2))  # [H, n, D]
    assert chunks[1, 0, 1].equal(v[64:].permute(1, 0, 2))
    back = torch.zeros_like(kv)
    scatter_chunks(chunks, [back], paged, table, 0, layout)
    assert back.equal(kv)


def test_vllm_flash_attn_4d_layout_splits_the_last_dim() -> None:
    """vLLM 0.32's FlashAttention/Triton: logical [B, H, N, 2D], K = [..., :D], V = [..., D:]."""
    layout = ChunkLayout(
        model_id="t", dtype="float32", num_layers=1, num_kv_heads=3, head_dim=8, chunk_tokens=32
    )
    bs = 16
    kv = torch.zeros((5, 3, bs, 16))
    key_cache, value_cache = kv.transpose(1, 2).split(8, dim=-1)  # [B, N, H, D] each
    k, v = _token_kv(layout, 32)
    table = [3, 1]
    for tok in range(32):
        key_cache[table[tok // bs], tok % bs] = k[tok]
        value_cache[table[tok // bs], tok % bs] = v[tok]
    (chunk,) = gather_chunks(
        [kv], PagedLayout(kind="flash_attn", block_size=bs), table, 0, 1, layout
    )
    assert chunk[0, 0].equal(k.permute(1, 0, 2)) and chunk[0, 1].equal(v.permute(1, 0, 2))


def test_vllm_unknown_layout_is_refused_with_its_shape() -> None:
    cpu = PagedLayout(kind="cpu", block_size=128)
    cpu.check(torch.empty(182, 3, 128, 128), 3, 64)  # the tensor
    with pytest.raises(ValueError, match=r"shape \[182, 3, 128, 128\].*paged_layout"):
        PagedLayout(kind="flash_attn_5d", block_size=128).check(
            torch.empty(182, 3, 128, 128), 3, 64
        )
    with pytest.raises(ValueError, match="shape"):
        cpu.check(torch.empty(182, 3, 64, 128), 3, 64)  # kernel blocks of another size
    assert paged_kind_for(["CPU_ATTN"], (182, 3, 128, 128)) == "cpu"
    assert paged_kind_for(["FLASH_ATTN"], (10, 8, 16, 256)) == "flash_attn"
    assert paged_kind_for(["FLASH_ATTN"], (2, 10, 16, 8, 128)) == "flash_attn_5d"
    with pytest.raises(ValueError, match=r"unknown vLLM KV layout.*FLASHINFER"):
        paged_kind_for(["FLASHINFER"], (10, 8, 16, 256))


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


def test_lmcache_object_shapes_keys_and_addresses() -> None:
    full = [2, 30, 256, 192]  # KV_2LTD: kv, layers, tokens, hidden
    full_bytes = 2 * 30 * 256 * 192 * 4
    assert object_shape(full, full_bytes, full_bytes) == full
    assert object_shape(full, full_bytes, full_bytes // 256 * 232) == [2, 30, 232, 192]
    assert object_shape(full, full_bytes, full_bytes // 256 * 232 + 4) is None  # no whole token
    assert object_shape(full, full_bytes, full_bytes * 2) is None
    assert object_shape([256, 576], 256 * 576 * 2, 10 * 576 * 2) == [10, 576]  # MLA: dim 0
    a, b = tier_key(b"s" * 16, "model@1@0@abc"), tier_key(b"t" * 16, "model@1@0@abc")
    assert len(a) == 16 and a != b  # salted per tenant
    assert parse_dpukv_url("dpukv://10.0.0.2:7400/acme") == ("tcp://10.0.0.2:7400", "acme")
    with pytest.raises(ValueError, match="dpukv://HOST:PORT/TENANT"):
        parse_dpukv_url("dpukv://10.0.0.2/acme")
    extra = {"dpukv.control": "tcp://10.0.0.2:7400", "dpukv.tenant": "acme"}
    assert agent_address("plugin://dpukv", extra) == ("tcp://10.0.0.2:7400", "acme")
    assert agent_address("dpukv://h:1/t", {}) == ("tcp://h:1", "t")
    with pytest.raises(ValueError, match=r"dpukv\.control"):
        agent_address("plugin://dpukv", {"dpukv.tenant": "acme"})


def test_lmcache_module_imports_without_lmcache() -> None:
    import host_shim.integrations.lmcache as mod

    if importlib.util.find_spec("lmcache") is None:
        with pytest.raises(ModuleNotFoundError, match="lmcache"):
            _ = mod.DpuKVConnectorAdapter


# --- against a real agent --------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from dpu_agent.testing import spawn_agent

    proc = spawn_agent(tmp_path_factory.mktemp("agent"))
    yield proc
    proc.stop()


def test_vllm_save_then_load_through_the_agent(agent: Any) -> None:
    from host_shim.client import KVClient

    paged = PagedLayout(kind="cpu", block_size=16)
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
    assert paged.standard(fresh[0])[:, :, list(other[:2])].eq(0).all()  # chunk 0: vLLM's own


def test_vllm_save_gathers_only_chunks_the_agent_lacks(agent: Any) -> None:
    """The scheduler's hit count reaches save_request as first_chunk: the chunks before it are
    neither gathered nor sent (their blocks here do not even exist in the pool)."""
    from host_shim.client import KVClient

    paged = PagedLayout(kind="cpu", block_size=16)
    layers = [_random(paged.shape(12, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)]
    tokens = tuple(range(5000, 5000 + 4 * LAYOUT.chunk_tokens))
    table = (0, 1, 2, 3, 4, 5, 6, 7)
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        two = ReqStore(req_id="a", token_ids=tokens, block_ids=table, chunk_count=2)
        assert save_request(kv, layers, paged, LAYOUT, two) == 2
        bogus = (10_000, 10_001, 10_002, 10_003, 4, 5, 6, 7)  # chunks 0-1 out of the pool
        rest = ReqStore(req_id="a", token_ids=tokens, block_ids=bogus, chunk_count=4, first_chunk=2)
        assert save_request(kv, layers, paged, LAYOUT, rest) == 4
        assert kv.lookup(list(tokens)) == 4
        bufs = torch.empty((4, *LAYOUT.chunk_shape), dtype=torch.float16)
        assert kv.get(list(tokens), list(bufs.unbind(0))) == 4
    assert _bits(bufs).equal(_bits(gather_chunks(layers, paged, table, 0, 4, LAYOUT)))


def test_vllm_load_miss_after_match_reports_its_blocks_and_leaves_them(agent: Any) -> None:
    """A chunk deleted between the scheduler's match and the worker's load: the load stops
    there, the blocks of that chunk and the ones after it are named for vLLM to recompute, and
    nothing is written into them."""
    from host_shim.client import KVClient

    paged = PagedLayout(kind="cpu", block_size=16)
    layers = [_random(paged.shape(12, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)]
    tokens = tuple(range(9000, 9000 + 3 * LAYOUT.chunk_tokens + 1))
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        store = ReqStore(req_id="a", token_ids=tokens, block_ids=tuple(range(6)), chunk_count=3)
        assert save_request(kv, layers, paged, LAYOUT, store) == 3
        hits, lease_id = kv.lease(list(tokens))  # the scheduler's match
        assert hits == 3 and lease_id
        kv.channel.call("delete", key=kv.keys(list(tokens))[1])  # gone before the load
        fresh = [torch.zeros_like(x) for x in layers]
        other = (6, 7, 8, 9, 10, 11)
        load = ReqLoad(req_id="b", token_ids=tokens, block_ids=other, first_chunk=0, chunk_count=3)
        loaded = load_request(kv, fresh, paged, LAYOUT, load)
        kv.release_lease(lease_id)
    assert loaded == 1
    assert failed_block_ids(load, loaded, LAYOUT.chunk_tokens, 16) == {8, 9, 10, 11}
    assert _bits(gather_chunk(fresh, paged, other, 0, LAYOUT)).equal(
        _bits(gather_chunk(layers, paged, tuple(range(6)), 0, LAYOUT))
    )
    for x in fresh:
        assert paged.standard(x)[:, :, [8, 9, 10, 11]].eq(0).all()


def test_lease_keeps_matched_chunks_from_eviction(agent: Any) -> None:
    from host_shim.client import ControlChannel, KVClient

    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=torch.float16)
    tokens = list(range(20_000, 20_000 + 2 * LAYOUT.chunk_tokens))
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        assert kv.put(tokens, [chunk, chunk]) == 2
        hits, lease_id = kv.lease(tokens)
        assert hits == 2 and lease_id
        with ControlChannel(agent.control_url, "_admin", agent.admin_token) as admin:
            admin.connect()
            admin.call("evict", tenant="default", bytes=1 << 40)
            assert kv.lookup(tokens) == 2  # leased: not evicted
            kv.release_lease(lease_id)
            kv.release_lease(lease_id)  # twice, or expired: not an error
            admin.call("evict", tenant="default", bytes=1 << 40)
        assert kv.lookup(tokens) == 0


def test_lmcache_objects_through_the_agent_in_batches(agent: Any) -> None:
    """Objects of two sizes (full chunks and a partial last one) in one batch each way: one
    lookup, then one write (or read) call per run of equal sizes, bytes exact, prefix rules."""
    from host_shim.client import KVClient

    salt = os.urandom(32)
    layout = ChunkLayout(
        model_id="lmcache", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1
    )
    with KVClient(agent.control_url, "default", agent.token, layout, salt) as kv:
        objects = KeyedChunks(kv)
        keys = [tier_key(salt, f"SmolLM2@1@0@{i:x}@float32") for i in range(4)]
        data = [os.urandom(40_960) for _ in range(3)] + [os.urandom(12_288)]
        assert objects.count(keys) == 0 and objects.lengths(keys) == []
        assert objects.write(keys, [bytearray(d) for d in data], None) == 4
        assert objects.count(keys) == 4
        assert objects.lengths(keys) == [40_960] * 3 + [12_288]
        bufs = [bytearray(n) for n in objects.lengths(keys)]
        assert objects.read_into(keys, bufs) == 4
        assert [bytes(b) for b in bufs] == data
        # a buffer of the wrong size for its object: that object and the rest are misses
        short = [bytearray(40_960), bytearray(40_960), bytearray(4096), bytearray(12_288)]
        assert objects.read_into(keys, short) == 2


def test_vllm_store_does_not_wait_for_a_stalled_agent(agent: Any) -> None:
    """The connector's stores leave the forward at once: with the agent stopped (SIGSTOP),
    AsyncSaver.save copies the chunks and returns before any put is acknowledged; a store
    over the queue's byte cap is dropped, not waited for; once the agent runs again the
    queued chunks reach it."""
    import signal

    from host_shim.client import KVClient
    from host_shim.integrations.vllm import AsyncSaver

    paged = PagedLayout(kind="cpu", block_size=16)
    layers = [_random(paged.shape(12, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)]
    tokens = tuple(range(20_000, 20_000 + 3 * LAYOUT.chunk_tokens + 1))
    other = tuple(range(30_000, 30_000 + LAYOUT.chunk_tokens + 1))
    salt = os.urandom(32)
    # a long timeout: the put waiting on the stopped agent must not count it as lost
    client = KVClient(agent.control_url, "default", agent.token, LAYOUT, salt, timeout_s=120.0)
    assert client.lookup(list(tokens)) == 0  # connected before the agent stops
    saver = AsyncSaver(client, LAYOUT, queue_bytes_max=3 * LAYOUT.chunk_bytes)
    try:
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            store = ReqStore(req_id="a", token_ids=tokens, block_ids=tuple(range(6)), chunk_count=3)
            assert saver.save(layers, paged, store)
            assert saver.stored == 0  # returned with nothing acknowledged: it did not wait
            full = ReqStore(req_id="b", token_ids=other, block_ids=(6, 7), chunk_count=1)
            assert not saver.save(layers, paged, full)  # over the cap: dropped
            assert saver.dropped == 1
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        assert saver.flush(120.0)
        assert saver.stored == 3
    finally:
        saver.close()
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, salt) as kv:
        assert kv.lookup(list(tokens)) == 3
        assert kv.lookup(list(other)) == 0


def test_vllm_throttled_tier_is_recomputed_not_loaded(agent: Any) -> None:
    """Load or recompute from measured figures: real loads through the agent make loading a
    matched prefix worth it against a slow prefill; the same agent throttled (stopped for part
    of each transfer) measures slower than recomputing, and the connector's decision flips, so
    a throttled tier never makes the first token later than no tier."""
    import signal
    import threading

    from host_shim.client import KVClient
    from host_shim.integrations.vllm import TierCostModel

    paged = PagedLayout(kind="cpu", block_size=16)
    layers = [_random(paged.shape(12, LAYOUT.num_kv_heads, LAYOUT.head_dim)) for _ in range(3)]
    tokens = tuple(range(40_000, 40_000 + 3 * LAYOUT.chunk_tokens + 1))
    cost = TierCostModel()
    nbytes = 3 * LAYOUT.chunk_bytes
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        store = ReqStore(req_id="a", token_ids=tokens, block_ids=tuple(range(6)), chunk_count=3)
        assert save_request(kv, layers, paged, LAYOUT, store) == 3

        def timed_load() -> float:
            fresh = [torch.zeros_like(x) for x in layers]
            load = ReqLoad(req_id="b", token_ids=tokens, block_ids=tuple(range(6)),
                           first_chunk=0, chunk_count=3)  # fmt: skip
            t0 = time.perf_counter()
            assert load_request(kv, fresh, paged, LAYOUT, load) == 3
            return time.perf_counter() - t0

        fast = timed_load()
        cost.observe_transfer(nbytes, fast)
        # a prefill rate at which the 96 tokens take 20x the measured load: loading wins
        cost.observe_prefill(96, 20 * fast)
        assert cost.worth_loading(96, nbytes)

        stall_s = max(2.0, 50 * fast)  # throttled: the agent stopped for part of every transfer
        for _ in range(20):  # the moving average follows a tier that stays throttled
            agent.proc.send_signal(signal.SIGSTOP)
            timer = threading.Timer(stall_s, agent.proc.send_signal, (signal.SIGCONT,))
            timer.start()
            try:
                slow = timed_load()
            finally:
                timer.join()
                agent.proc.send_signal(signal.SIGCONT)
            assert slow >= stall_s
            cost.observe_transfer(nbytes, slow)
            if not cost.worth_loading(96, nbytes):
                break
        assert not cost.worth_loading(96, nbytes)
        load_s, recompute_s = cost.load_s(nbytes), cost.recompute_s(96)
        assert load_s is not None and recompute_s is not None and load_s > recompute_s


def test_cost_samples_cross_processes_as_plain_lists_and_feed_the_scheduler_model() -> None:
    """The worker's timed work reaches the scheduler's model only as vLLM's connector stats
    (msgpack between processes): plain lists, bounded, merged across steps and workers, and
    fed to a model that skips what it cannot read."""
    from host_shim.integrations._vllm_core import (
        COST_SAMPLES_MAX,
        CostSamples,
        TierCostModel,
        merge_stats,
        reduce_stats,
    )

    samples = CostSamples()
    samples.add("load", 10 << 20, 0.5)
    samples.add("store", 10 << 20, 0.5)
    samples.add("prefill", 512, 1.0)
    samples.add("load", 0, 1.0)  # nothing moved: not a sample
    taken = samples.take()
    assert taken == [["load", 10 << 20, 0.5], ["store", 10 << 20, 0.5], ["prefill", 512, 1.0]]
    assert samples.take() == []  # taken once

    for _ in range(COST_SAMPLES_MAX + 10):
        samples.add("store", 1, 1.0)
    assert len(samples.take()) == COST_SAMPLES_MAX  # a scheduler that never took: bounded

    a = merge_stats({"samples": taken}, {"load_decisions": 1, "loaded_tokens": 256})
    b = merge_stats({"samples": [["load", 1 << 20, 0.1]]}, {"recompute_decisions": 2})
    both = merge_stats(a, b)
    assert both["load_decisions"] == 1 and both["recompute_decisions"] == 2
    assert len(both["samples"]) == 4
    assert reduce_stats(both)["load_bytes"] == (10 << 20) + (1 << 20)
    # the model's figures: the newest wins, and only a measured one is reported
    newest = merge_stats(merge_stats({"bytes_per_s": 1.0}, {}), {"bytes_per_s": 2.0})
    assert newest["bytes_per_s"] == 2.0 and "latency_s" not in newest
    assert reduce_stats(newest)["bytes_per_s"] == 2.0

    model = TierCostModel()
    assert model.worth_loading(256, 10 << 20)  # nothing measured yet: load
    used = model.feed([*both["samples"], ["warp", 1, 1.0], ["load", "x", 1.0], ["load"]])
    assert used == 4  # the three malformed samples were skipped, nothing raised
    assert model.prefill_tokens_per_s == 512.0
    assert model.bytes_per_s is not None and model.bytes_per_s > 10e6
    assert model.snapshot() == {"bytes_per_s": model.bytes_per_s, "prefill_tokens_per_s": 512.0}


def test_vllm_probe_measures_the_tier_before_any_match(agent: Any) -> None:
    """The scheduler times one chunk put and read back at start (and deletes it), so its
    first load-or-recompute decision has a measured tier."""
    from dpu_agent.bench.serve import _agent_used
    from host_shim.client import KVClient
    from host_shim.integrations._vllm_core import CostSamples, probe_tier

    samples = CostSamples()
    before = _agent_used(agent)
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        assert probe_tier(kv, LAYOUT, samples, torch.device("cpu"))
    kinds = [(s[0], s[1]) for s in samples.take()]
    assert kinds == [("store", LAYOUT.chunk_bytes), ("load", LAYOUT.chunk_bytes)]
    assert _agent_used(agent) == before  # the probe's chunk is gone again


def test_connector_copies_run_on_one_thread_and_give_the_forward_its_threads_back() -> None:
    """On a CPU engine the connector's gather/scatter share torch's OpenMP threads with the
    forward; on busy cores every split copy waited for a thread (a chunk's gather took ~1 s
    at load 15 on 2 cores, against 10 ms on one thread), on the request's path. They run on
    the calling thread alone, and the forward's thread count is restored afterwards, also
    when the copy raises."""
    from host_shim.integrations._vllm_core import single_threaded

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), single_threaded(torch.device("cpu")):
            raise RuntimeError("a copy failed")
        assert torch.get_num_threads() == 2
        with single_threaded(torch.device("meta")):  # not CPU: the engine's threads untouched
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cost_model_skips_samples_that_would_poison_its_averages() -> None:
    """A NaN or infinite duration, or a non-positive amount, from the stats channel is
    skipped: one of them kept the tier's bandwidth at NaN for good (every match recomputed)."""
    from host_shim.integrations._vllm_core import TierCostModel

    cost = TierCostModel()
    bad = [["load", 10**30, float("nan")], ["store", -5, 1.0], ["prefill", 100, float("inf")],
           ["load", 10**400, 1.0], ["x"], None, ["load", "a", 1]]  # fmt: skip
    assert cost.feed(bad) == 0
    assert cost.snapshot() == {}
    assert cost.feed([["load", 11_800_000, 2.0], ["prefill", 300, 0.3]]) == 2
    snap = cost.snapshot()
    assert snap["bytes_per_s"] == pytest.approx(5_900_000)
    assert snap["prefill_tokens_per_s"] == pytest.approx(1000)
