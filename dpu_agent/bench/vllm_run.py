"""Runs real vLLM (its CPU build) offline on one prompt, with or without the tier's connector.

Runs inside the vLLM virtual environment (`make test-engines` builds `.venv-vllm`), started by
`dpu_agent.bench.engines` for `dpuctl bench ttft --vllm` and the engine tests::

    .venv-vllm/bin/python -m dpu_agent.bench.vllm_run SPEC.json

and prints one JSON line when the engine is ready and one per run. The spec: ``model`` (a
folder), ``prompt_token_ids``, ``max_tokens``, ``connector`` (null for plain vLLM, else the
connector's ``kv_connector_extra_config``), ``prefix_caching`` (vLLM's own; default off),
optional ``connector_module`` / ``connector_class`` (a subclass, e.g. the tests' fault
injector), ``warmup_token_ids`` (a prompt run once first, untimed), and ``runs``: a list of
``{"name", "max_tokens"?, "sleep_s"?}``, each one ``generate()`` of the prompt (after
``sleep_s`` idle). Only vLLM, torch and host_shim are imported here (the vLLM venv has no agent).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

__all__ = ["main"]


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kv_transfer = None
    if spec.get("connector") is not None:
        kv_transfer = {
            "kv_connector": spec.get("connector_class", "DpuKVConnector"),
            "kv_connector_module_path": spec.get("connector_module", "host_shim.integrations.vllm"),
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    return LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=int(spec.get("max_model_len", 8192)),
        # off by default: every hit is the tier's; on to measure the connector beside vLLM's own
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        enforce_eager=True,  # no torch.compile: minutes on 2 cores, same numbers
        kv_transfer_config=kv_transfer,
        seed=0,
    )


def _generate(llm: Any, ids: list[int], max_tokens: int) -> tuple[Any, float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return out, time.perf_counter() - t0


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = _llm(spec)
    if spec.get("warmup_token_ids"):
        _generate(llm, spec["warmup_token_ids"], 1)
    ready = {"event": "ready", "init_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(ready), flush=True)
    for run in spec["runs"]:
        time.sleep(float(run.get("sleep_s", 0)))  # idle first: lets background work finish
        out, total_s = _generate(llm, spec["prompt_token_ids"], run.get("max_tokens", 16))
        comp = out.outputs[0]
        row = {
            "event": "run",
            "name": run["name"],
            "tokens": list(comp.token_ids),
            "logprobs": [next(iter(lp.values())).logprob for lp in comp.logprobs or []],
            "num_cached_tokens": out.num_cached_tokens,
            "total_s": round(total_s, 4),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: an 8k-token prompt needs 0.4
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1])
