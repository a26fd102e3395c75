"""dpuctl plan capacity: the arithmetic, the Hugging Face config path, bad input, and every
worked example in docs/CAPACITY.md run and compared with the figures printed there."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.capacity import (
    INDEX_BYTES_PER_RECORD,
    CapacityError,
    Deployment,
    ModelShape,
    plan_capacity,
    shape_from_hf_config,
)
from dpu_agent.cli import cli

REPO = Path(__file__).parent.parent
HF_70B = REPO / "tests/data/capacity/llama-3-70b-config.json"


def test_70b_class_figures_by_hand() -> None:
    shape = ModelShape(layers=80, kv_heads=8, head_dim=128, dtype="float16")
    r = plan_capacity(shape, Deployment(context_tokens=131072, ttft_target_ms=2000))
    assert r["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert r["chunk_bytes"] == 256 * 327_680 == 80 << 20
    assert r["session_bytes"] == 40 << 30
    assert r["stored_bytes_per_gpu"] == 512 * (40 << 30)
    assert r["vs_architecture"] == "within"  # 21.99 TB
    records = 8 * 512 * 131072 // 256
    assert r["records_per_dpu"] == records
    assert r["index_bytes_per_node"] == records * INDEX_BYTES_PER_RECORD
    assert r["network"]["gbps_per_gpu"] == round((40 << 30) * 8 / 2 / 1e9, 1)


def test_hit_rate_dpus_and_hot_sessions_scale_what_they_should() -> None:
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    base = plan_capacity(shape, Deployment(context_tokens=32768))
    half = plan_capacity(shape, Deployment(context_tokens=32768, hit_rate=0.5))
    two = plan_capacity(shape, Deployment(context_tokens=32768, dpus_per_node=2))
    cold = plan_capacity(shape, Deployment(context_tokens=32768, hot_sessions_per_gpu=0))
    assert half["stored_bytes_per_gpu"] * 2 == base["stored_bytes_per_gpu"]
    assert two["nvme_bytes_per_dpu"] * 2 == pytest.approx(base["nvme_bytes_per_dpu"], rel=1e-9)
    assert two["index_bytes_per_node"] == base["index_bytes_per_node"]  # same records in all
    assert cold["dram_bytes_per_dpu"] == base["records_per_dpu"] * INDEX_BYTES_PER_RECORD
    assert base["network"] is None  # no TTFT target


def test_hf_config_gives_the_same_shape_and_flags_override_it(tmp_path: Path) -> None:
    shape = shape_from_hf_config(HF_70B)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == (80, 8, 128, "bfloat16")
    r = CliRunner().invoke(cli, ["plan", "capacity", "--hf-config", str(HF_70B), "--kv-heads",
                                 "2", "--context-tokens", "1024", "--json"])  # fmt: skip
    assert r.exit_code == 0 and json.loads(r.output)["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2
    nested = tmp_path / "vlm.json"
    nested.write_text(json.dumps({"text_config": json.loads(HF_70B.read_text())}))
    assert shape_from_hf_config(nested).layers == 80
    (tmp_path / "bad.json").write_text('{"hidden_size": 10}')
    with pytest.raises(CapacityError, match="not a decoder config"):
        shape_from_hf_config(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "80", "--context-tokens", "10"], "--kv-heads, --head-dim"),
        (["--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--context-tokens", "10"],
         "layers = 0"),
        (["--hf-config", "/nonexistent.json", "--context-tokens", "10"], "cannot read"),
        (["--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--context-tokens", "10",
          "--hit-rate", "0"], "hit-rate"),
        (["--layers", "1", "--kv-heads", "1", "--head-dim", "1"], "--context-tokens"),
    ],
)  # fmt: skip
def test_bad_input_is_a_usage_error(args: list[str], message: str) -> None:
    r = CliRunner().invoke(cli, ["plan", "capacity", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def _doc_examples() -> list[tuple[str, dict]]:
    text = (REPO / "docs/CAPACITY.md").read_text()
    pairs = re.findall(
        r"```\n(dpuctl plan capacity [^\n]+)\n```\n\n```json\n(.*?)\n```", text, re.S
    )
    return [(cmd, json.loads(expected)) for cmd, expected in pairs]


def test_docs_worked_examples_match_the_calculator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the examples name files relative to the repository
    examples = _doc_examples()
    assert len(examples) >= 3
    assert any(
        "--layers 80 --kv-heads 8 --head-dim 128 --dtype float16 --context-tokens 131072" in cmd
        for cmd, _ in examples
    )  # the 70B-class example the issue asks for
    for cmd, expected in examples:
        r = CliRunner().invoke(cli, shlex.split(cmd)[1:])
        assert r.exit_code == 0, (cmd, r.output)
        got = json.loads(r.output)
        assert {k: got[k] for k in expected} == expected, cmd


# DeepSeek-V3's config.json, the fields that decide its KV shape (MLA: a 512-wide compressed
# latent plus a 64-wide RoPE key per token and layer, no separate K and V per head)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_mla_model_is_sized_by_its_latent_not_by_k_and_v_per_head(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    r = CliRunner().invoke(cli, ["plan", "capacity", "--hf-config", str(path),
                                 "--context-tokens", "131072", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272  # ~70 KB, not 1.7 MB
    assert doc["model"]["attention"] == "mla"
    assert doc["nvme_fits_dpu"] and not doc["warnings"]


def test_plan_needing_more_nvme_than_one_dpu_holds_warns(tmp_path: Path) -> None:
    args = ["plan", "capacity", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
            "--context-tokens", "131072", "--sessions-per-gpu", "2048"]  # fmt: skip
    r = CliRunner().invoke(cli, [*args, "--json"])
    doc = json.loads(r.output)
    assert not doc["nvme_fits_dpu"] and "more than one DPU holds" in doc["warnings"][0]
    human = CliRunner().invoke(cli, args)
    assert "warning: NVMe per DPU" in human.output and "DPUs per node" in human.output
    fits = CliRunner().invoke(cli, [*args, "--nvme-per-dpu", "2PB", "--json"])
    assert json.loads(fits.output)["nvme_fits_dpu"]
