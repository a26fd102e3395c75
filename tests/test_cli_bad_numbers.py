"""Numbers and paths the benches and the capacity planner took and then raised on (attack
pass 3): each is now a usage error (exit 2) naming the option, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["plan", "capacity", "--context-tokens", "1000", "--layers", "80", "--kv-heads", "8",
          "--head-dim", "128", "--nvme-per-dpu", "0"], "--nvme-per-dpu"),
        (["bench", "index", "--records", "10", "--seed", "-1"], "--seed"),
        (["bench", "recovery", "--records", "100", "--policy", "bogus"], "--policy"),
        (["bench", "--record", "/proc/nope/x.json", "crypto", "--chunk-mib", "1", "--repeats",
          "1", "--json"], "--record"),
    ],
    ids=["nvme-per-dpu-0", "seed-negative", "policy-unknown", "record-unwritable"],
)  # fmt: skip
def test_a_bad_number_or_path_is_a_usage_error(args: list[str], says: str) -> None:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_a_hugging_face_config_with_an_absurd_layer_count(tmp_path: Path) -> None:
    hf = tmp_path / "config.json"
    hf.write_text('{"num_hidden_layers": 1e400, "num_attention_heads": 8, "hidden_size": 64}')
    r = CliRunner().invoke(cli, ["plan", "capacity", "--hf-config", str(hf), "--context-tokens",
                                 "1000", "--json"])  # fmt: skip
    assert r.exit_code == 2 and "not a decoder config" in r.output, r.output
