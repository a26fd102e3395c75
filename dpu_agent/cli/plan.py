"""`dpuctl plan capacity`: what a deployment needs from the tier (pure arithmetic, no agent).

Exit codes: 0 done; 2 usage (a missing or invalid option, an unreadable --hf-config).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from dpu_agent.capacity import (
    DPU_NVME_BYTES_DEFAULT,
    CapacityError,
    Deployment,
    ModelShape,
    plan_capacity,
)
from dpu_agent.capacity import shape_from_hf_config as hf_shape
from dpu_agent.cli.ops import SIZE
from kvproto.keys import DTYPE_ITEMSIZE

__all__ = ["plan_group"]


@click.group("plan", help="Planning calculators.")
def plan_group() -> None:
    pass


def _shape(hf_config: str | None, dtype: str | None, **dims: int | None) -> ModelShape:
    if hf_config is not None:
        base = hf_shape(hf_config, dtype)
        given: dict[str, Any] = {k: v for k, v in dims.items() if v is not None}  # e.g. TP
        return dataclasses.replace(base, **given)
    missing = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is None]
    if missing:
        raise click.UsageError(f"give {', '.join(missing)} (or --hf-config FILE)")
    return ModelShape(dtype=dtype or "float16", **dims)  # type: ignore[arg-type]


def _human(r: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = [
        f"KV bytes per token   {r['kv_bytes_per_token']:,}"
        + (" (MLA latent)" if r["model"]["attention"] == "mla" else ""),
        f"chunk                {r['chunk_bytes'] / (1 << 20):,.1f} MiB "
        f"({r['deployment']['chunk_tokens']} tokens)",
        f"one session          {r['session_bytes'] / gib:,.1f} GiB "
        f"({r['deployment']['context_tokens']:,} tokens)",
        f"per GPU              {r['tb_per_gpu']:,.2f} TB ({r['vs_architecture']} the "
        f"architecture's {r['architecture_tb_per_gpu'][0]}-{r['architecture_tb_per_gpu'][1]} TB)",
        f"NVMe per DPU         {r['nvme_tb_per_dpu']:,.2f} TB "
        f"({'fits' if r['nvme_fits_dpu'] else 'over'} "
        f"{r['deployment']['nvme_bytes_per_dpu'] / 10**12:,.2f} TB)",
        f"DRAM per DPU         {r['dram_bytes_per_dpu'] / gib:,.1f} GiB "
        f"({'fits' if r['dram_fits_bf3'] else 'over'} a BF3's 32 GB)",
        f"index per node       {r['index_bytes_per_node'] / (1 << 20):,.1f} MiB "
        f"({r['records_per_dpu']:,} records per DPU x {r['index_bytes_per_record']} B)",
    ]
    lines.extend(f"warning: {w}" for w in r["warnings"])
    if r["network"]:
        n = r["network"]
        lines.append(f"network per GPU      {n['gbps_per_gpu']:,.1f} Gb/s; per DPU "
                     f"{n['gbps_per_dpu']:,.1f} Gb/s ({'fits' if n['fits_bf3_400g'] else 'over'} "
                     "400 Gb/s)")  # fmt: skip
    return "\n".join(lines)


@plan_group.command("capacity", help="KV bytes/token, chunk, TB per GPU, NVMe/DRAM/index per "
                    "DPU, network for a TTFT target.")  # fmt: skip
@click.option("--layers", type=int, default=None, help="Transformer layers.")
@click.option("--kv-heads", type=int, default=None, help="KV heads one GPU holds.")
@click.option("--head-dim", type=int, default=None, help="Head dimension.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_ITEMSIZE)), default=None,
              help="KV dtype (default float16, or the config's).")  # fmt: skip
@click.option("--hf-config", type=click.Path(dir_okay=False), default=None,
              help="A Hugging Face config.json instead of (or under) the flags above.")  # fmt: skip
@click.option("--context-tokens", type=click.IntRange(min=1), required=True,
              help="Context length of one session.")  # fmt: skip
@click.option("--sessions-per-gpu", type=click.IntRange(min=1), default=512, show_default=True,
              help="Contexts each GPU keeps in the tier.")  # fmt: skip
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--dpus-per-node", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--hot-sessions-per-gpu", type=click.IntRange(min=0), default=1, show_default=True,
              help="Contexts per GPU the DRAM tier holds.")  # fmt: skip
@click.option("--hit-rate", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True, help="Share of contexts the tier retains.")  # fmt: skip
@click.option("--ttft-target-ms", type=click.FloatRange(0, min_open=True), default=None,
              help="Time to load a cached context (network section).")  # fmt: skip
@click.option("--nvme-per-dpu", type=SIZE, default=DPU_NVME_BYTES_DEFAULT,
              help="NVMe one DPU holds (default 245.76 TB: 8 x 30.72 TB drives).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def capacity_cmd(
    layers: int | None, kv_heads: int | None, head_dim: int | None, dtype: str | None,
    hf_config: str | None, context_tokens: int, sessions_per_gpu: int, gpus_per_node: int,
    dpus_per_node: int, chunk_tokens: int, hot_sessions_per_gpu: int, hit_rate: float,
    ttft_target_ms: float | None, nvme_per_dpu: int,
    as_json: bool,
) -> None:  # fmt: skip
    if nvme_per_dpu <= 0:  # a divisor below (ZeroDivisionError)
        raise click.BadParameter("must be more than 0 bytes", param_hint="--nvme-per-dpu")
    try:
        shape = _shape(hf_config, dtype, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
        d = Deployment(context_tokens=context_tokens, sessions_per_gpu=sessions_per_gpu,
                       gpus_per_node=gpus_per_node, dpus_per_node=dpus_per_node,
                       chunk_tokens=chunk_tokens, hot_sessions_per_gpu=hot_sessions_per_gpu,
                       hit_rate=hit_rate,
                       ttft_target_ms=ttft_target_ms,
                       nvme_bytes_per_dpu=nvme_per_dpu)  # fmt: skip
        result = plan_capacity(shape, d)
    except CapacityError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(_human(result))
