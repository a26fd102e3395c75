"""Capacity planning for the context-memory tier (`dpuctl plan capacity`): from a model's KV
shape and a deployment, how many bytes each GPU's contexts take, what each DPU needs in NVMe,
DRAM and index memory, and the network bandwidth a TTFT target asks for.

The model (all sizes in bytes; TB = 10^12 bytes, Gb/s = 10^9 bits/s):

- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype size; with tensor
  parallelism give the KV heads one GPU holds. Multi-head latent attention (MLA: DeepSeek-V2/V3,
  a config with `kv_lora_rank`) caches one latent per token per layer instead of K and V:
  layers x (kv_lora_rank + qk_rope_head_dim) x dtype size (DeepSeek-V3 at bf16: 61 x 576 x 2 =
  70,272 bytes per token).
- chunk = `chunk_tokens` tokens (the agent's ChunkLayout, 256 by default).
- a session's context = context tokens x KV bytes per token; each GPU keeps `sessions_per_gpu`
  of them, of which the tier retains the hit-rate share: stored per GPU = sessions x context x
  hit rate (uniform reuse: keeping a fraction h of the contexts serves a fraction h of them).
- NVMe per DPU = stored per GPU x GPUs per DPU / fill target (0.9: room for the allocator and
  the journal); records per DPU = that / chunk bytes; index memory = records x 97 bytes (the
  engine's record index at 10M records, docs/BENCHMARKS.md, `dpuctl bench index`).
- DRAM per DPU = the hot sessions' contexts (`hot_sessions_per_gpu` per GPU, 1 by default: the
  session each GPU is serving now, so a follow-up turn hits DRAM) plus the index. A 70B-class
  model at 128k tokens needs 40 GiB per context: more than a BF3's DRAM for 8 GPUs, so its
  DRAM tier holds chunks in transit and the NVMe tier has to deliver the TTFT bandwidth.
- network: loading the cached share of one context within the TTFT target:
  context x hit rate / TTFT, per GPU, and per DPU when all its GPUs do so at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvproto.keys import DTYPE_ITEMSIZE

__all__ = [
    "ARCHITECTURE_TB_PER_GPU",
    "DPU_NVME_BYTES_DEFAULT",
    "INDEX_BYTES_PER_RECORD",
    "CapacityError",
    "Deployment",
    "ModelShape",
    "plan_capacity",
    "shape_from_hf_config",
]

INDEX_BYTES_PER_RECORD = 97  # measured at 10M records (docs/BENCHMARKS.md, Index)
ARCHITECTURE_TB_PER_GPU = (16, 32)  # the design's context memory per GPU
NVME_FILL_TARGET = 0.9
BF3_DRAM_BYTES = 32 * 10**9  # a B3220's on-board DDR (BLUEFIELD.md)
BF3_NETWORK_GBPS = 400  # two 200 GbE ports
# The NVMe one DPU fronts unless --nvme-per-dpu says otherwise: 8 drives of 30.72 TB, a full
# 1U NVMe shelf behind a BF3's PCIe Gen5 x16. A plan beyond it needs more DPUs per node.
DPU_NVME_BYTES_DEFAULT = 8 * 30_720 * 10**9
HF_CONFIG_BYTES_MAX = 1 << 20
TB, GB = 10**12, 10**9


class CapacityError(ValueError):
    """A planning input is invalid; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    source: str = "flags"
    # "mla": one latent vector per token and layer (head_dim = its width, kv_heads = 1) instead
    # of a K and a V per KV head
    attention: str = "mha"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise CapacityError(f"{name} = {value!r}: a positive integer")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise CapacityError(f"dtype {self.dtype!r}: one of {', '.join(sorted(DTYPE_ITEMSIZE))}")
        if self.attention not in ("mha", "mla"):
            raise CapacityError(f"attention {self.attention!r}: mha or mla")

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer_and_head = 1 if self.attention == "mla" else 2  # a latent, or K and V
        item = DTYPE_ITEMSIZE[self.dtype]
        return per_layer_and_head * self.layers * self.kv_heads * self.head_dim * item


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    context_tokens: int
    sessions_per_gpu: int = 512
    gpus_per_node: int = 8
    dpus_per_node: int = 1
    chunk_tokens: int = 256
    hot_sessions_per_gpu: int = 1
    hit_rate: float = 1.0
    ttft_target_ms: float | None = None
    nvme_bytes_per_dpu: int = DPU_NVME_BYTES_DEFAULT

    def __post_init__(self) -> None:
        for name in ("context_tokens", "sessions_per_gpu", "gpus_per_node", "dpus_per_node",
                     "chunk_tokens"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise CapacityError(f"{name} = {value!r}: a positive integer")
        if type(self.hot_sessions_per_gpu) is not int or self.hot_sessions_per_gpu < 0:
            raise CapacityError(f"hot_sessions_per_gpu = {self.hot_sessions_per_gpu!r}: >= 0")
        if not 0 < self.hit_rate <= 1:
            raise CapacityError(f"hit_rate = {self.hit_rate}: in (0, 1]")
        if self.ttft_target_ms is not None and not self.ttft_target_ms > 0:
            raise CapacityError(f"ttft_target_ms = {self.ttft_target_ms}: positive")


_HF_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
              "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # fmt: skip


def shape_from_hf_config(path: str | Path, dtype: str | None = None) -> ModelShape:
    """Layers, KV heads and head dim from a Hugging Face config.json (text_config if nested)."""
    p = Path(path)
    try:
        raw = p.read_bytes()[:HF_CONFIG_BYTES_MAX]
        doc = json.loads(raw)
    except (OSError, ValueError) as e:
        raise CapacityError(f"cannot read Hugging Face config {p}: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = {**doc, **doc["text_config"]}
    attention = "mha"
    try:
        layers = int(doc["num_hidden_layers"])
        if doc.get("kv_lora_rank"):  # MLA: the cache holds the compressed latent + RoPE key
            attention, kv_heads = "mla", 1
            head_dim = int(doc["kv_lora_rank"]) + int(doc.get("qk_rope_head_dim") or 0)
        else:
            heads = int(doc["num_attention_heads"])
            kv_heads = int(doc.get("num_key_value_heads") or heads)
            head_dim = int(doc.get("head_dim") or doc["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise CapacityError(f"{p}: not a decoder config with layers and heads ({e!r})") from None
    hf_dtype = str(doc.get("torch_dtype") or doc.get("dtype") or "float16")
    chosen = dtype or _HF_DTYPES.get(hf_dtype, hf_dtype)
    return ModelShape(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=chosen,
                      source=str(p), attention=attention)  # fmt: skip


def plan_capacity(model: ModelShape, d: Deployment) -> dict[str, Any]:
    per_token = model.kv_bytes_per_token
    session = per_token * d.context_tokens
    stored_gpu = session * d.sessions_per_gpu * d.hit_rate
    gpus_per_dpu = d.gpus_per_node / d.dpus_per_node
    chunk = per_token * d.chunk_tokens
    nvme_dpu = stored_gpu * gpus_per_dpu / NVME_FILL_TARGET
    records_dpu = math.ceil(stored_gpu * gpus_per_dpu / chunk)
    index_node = records_dpu * d.dpus_per_node * INDEX_BYTES_PER_RECORD
    dram_dpu = (
        session * d.hot_sessions_per_gpu * gpus_per_dpu + records_dpu * INDEX_BYTES_PER_RECORD
    )
    tb_gpu = stored_gpu / TB
    lo, hi = ARCHITECTURE_TB_PER_GPU
    out: dict[str, Any] = {
        "model": {**asdict(model), "kv_bytes_per_token": per_token},
        "deployment": asdict(d),
        "kv_bytes_per_token": per_token,
        "chunk_bytes": chunk,
        "chunks_per_session": math.ceil(d.context_tokens / d.chunk_tokens),
        "session_bytes": session,
        "stored_bytes_per_gpu": round(stored_gpu),
        "tb_per_gpu": round(tb_gpu, 3),
        "architecture_tb_per_gpu": [lo, hi],
        "vs_architecture": "below" if tb_gpu < lo else "above" if tb_gpu > hi else "within",
        "nvme_bytes_per_dpu": round(nvme_dpu),
        "nvme_tb_per_dpu": round(nvme_dpu / TB, 3),
        "records_per_dpu": records_dpu,
        "index_bytes_per_record": INDEX_BYTES_PER_RECORD,
        "index_bytes_per_node": index_node,
        "dram_bytes_per_dpu": round(dram_dpu),
        "dram_fits_bf3": dram_dpu <= BF3_DRAM_BYTES,
        "nvme_fits_dpu": nvme_dpu <= d.nvme_bytes_per_dpu,
        "network": None,
        "warnings": [],
    }
    if nvme_dpu > d.nvme_bytes_per_dpu:
        need = math.ceil(nvme_dpu / d.nvme_bytes_per_dpu) * d.dpus_per_node
        out["warnings"].append(
            f"NVMe per DPU {nvme_dpu / TB:,.1f} TB is more than one DPU holds "
            f"({d.nvme_bytes_per_dpu / TB:,.2f} TB, --nvme-per-dpu): use {need} DPUs per node, "
            "fewer sessions per GPU or a lower hit rate"
        )
    if d.ttft_target_ms is not None:
        load = session * d.hit_rate
        gbps_gpu = load * 8 / (d.ttft_target_ms / 1000) / GB
        out["network"] = {
            "load_bytes_per_request": round(load),
            "gbps_per_gpu": round(gbps_gpu, 1),
            "gbps_per_dpu": round(gbps_gpu * gpus_per_dpu, 1),
            "fits_bf3_400g": gbps_gpu * gpus_per_dpu <= BF3_NETWORK_GBPS,
        }
    return out
