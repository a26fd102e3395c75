"""`dpuctl spdk ...` and the rpc.py plugin, against the simulator."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from spdk_sim.fixtures import KEYS, config_text
from spdk_sim.sim import SpdkSimulator

from dpu_agent import spdk_ops as ops
from dpu_agent.cli import cli
from dpu_agent.crypto.keystore import env_var_name

SPDK_RPC = Path(sys.executable).parent / "spdk-rpc"


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    aio = tmp_path / "disk0.img"
    with open(aio, "wb") as f:
        f.truncate(64 << 20)
    cfg = tmp_path / "agent.toml"
    sock = str(tmp_path / "spdk.sock")
    cfg.write_text(config_text(str(aio), sock))
    key, key2 = KEYS["key-a"]
    monkeypatch.setenv(env_var_name("key-a"), key + key2)  # the agent key store's environment
    with SpdkSimulator(sock):
        yield str(cfg), sock


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["spdk", *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_plan_apply_status_round_trip(setup) -> None:
    cfg, _ = setup
    code, out = _run("plan", "--config", cfg, "--json")
    assert code == 0
    steps = json.loads(out)["steps"]
    assert steps[0]["method"] == "accel_crypto_key_create"
    assert steps[0]["params"]["key"] == "<redacted>"
    code, out = _run("status", "--config", cfg)
    assert code == 1 and "missing" in out
    code, out = _run("apply", "--config", cfg)
    assert code == 0 and "converged" in out
    for key in KEYS["key-a"]:
        assert key not in out
    assert _run("status", "--config", cfg) == (0, "in sync\n")
    code, out = _run("plan", "--config", cfg)
    assert (code, out) == (0, "in sync: nothing to do\n")


def test_bad_config_exit_4_names_field(setup, tmp_path: Path) -> None:
    cfg, _ = setup
    text = Path(cfg).read_text().replace('key_name = "key-a"', 'key_name = "nope"')
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    code, out = _run("plan", "--config", str(bad), "--json")
    assert code == 4
    assert json.loads(out)["error"].startswith("spdk.crypto[0].key_name: unknown key 'nope'")


def test_unreachable_socket_exit_3(setup, tmp_path: Path) -> None:
    cfg, _ = setup
    code, out = _run("plan", "--config", cfg, "--socket", str(tmp_path / "none.sock"))
    assert code == 3 and "is spdk_tgt running" in out


def test_spdk_error_exit_1_reports_code(setup, tmp_path: Path) -> None:
    cfg, _ = setup
    text = Path(cfg).read_text().replace("disk0.img", "missing.img")
    bad = tmp_path / "missing.toml"
    bad.write_text(text)
    code, out = _run("apply", "--config", str(bad), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["code"] == -2 and doc["step"]["method"] == "bdev_aio_create"


def test_boot_config_redacted_and_with_keys_0600(setup, tmp_path: Path) -> None:
    cfg, _ = setup
    code, out = _run("boot-config", "--config", cfg)
    assert code == 0 and json.loads(out)["subsystems"][0]["subsystem"] == "accel"
    assert "<redacted>" in out
    code, out = _run("boot-config", "--config", cfg, "--with-keys")
    assert code == 4 and "--output" in out
    target = tmp_path / "spdk.json"
    code, out = _run("boot-config", "--config", cfg, "--with-keys", "--output", str(target))
    assert code == 0 and KEYS["key-a"][0] not in out
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert KEYS["key-a"][0] in target.read_text()


def test_tiers(setup) -> None:
    cfg, _ = setup
    code, out = _run("tiers", "--config", cfg, "--json")
    assert code == 0
    assert [(t["tier"], t["nsid"]) for t in json.loads(out)] == [("dram", 1), ("nvme", 2)]


def test_rpc_py_plugin_through_real_rpc_py(setup) -> None:
    """SPDK's own rpc.py (the PyPI package's spdk-rpc) loads the plugin with --plugin."""
    cfg, sock = setup
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [str(SPDK_RPC), "-s", sock, "--plugin", "dpu_agent.spdk_rpc_plugin"]
    for sub, check in (
        ("kvtier_plan", lambda d: d["steps"][0]["params"]["key"] == "<redacted>"),
        ("kvtier_apply", lambda d: d["after"]["steps"] == []),
        ("kvtier_status", lambda d: d["in_sync"] is True),
    ):
        proc = subprocess.run(
            [*cmd, sub, "-c", cfg], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stderr
        assert check(json.loads(proc.stdout)), (sub, proc.stdout)
        assert KEYS["key-a"][0] not in proc.stdout + proc.stderr


def test_plan_with_a_conflict_is_not_in_sync_and_exits_1(setup, tmp_path: Path) -> None:
    """Finding 5: `plan` printed "in sync: nothing to do" next to a CONFLICT line, exit 0."""
    cfg, _ = setup
    assert _run("apply", "--config", cfg)[0] == 0
    changed = tmp_path / "changed.toml"  # a transport option SPDK cannot change in place
    changed.write_text(
        Path(cfg).read_text().replace("in_capsule_data_size = 4096", "in_capsule_data_size = 8192")
    )
    code, out = _run("plan", "--config", str(changed))
    assert code == 1 and "CONFLICT" in out and "in sync" not in out
    code, out = _run("plan", "--config", str(changed), "--json")
    assert code == 1 and json.loads(out)["conflicts"]


def test_apply_with_conflicts_left_is_not_converged_and_exits_1(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5: `apply --json` exited 0 and printed "converged" while its re-plan still had
    conflicts (SPDK mode then refused to start). The CLI's verdict on such a result:"""
    cfg, _ = setup
    real = ops.run_apply

    def with_conflict_left(*args: Any) -> Any:
        result = real(*args)
        result["after"]["conflicts"].append("spdk.crypto[0].base_bdev_name: left over")
        return result

    monkeypatch.setattr(ops, "run_apply", with_conflict_left)
    code, out = _run("apply", "--config", cfg)
    assert code == 1 and "NOT converged" in out and "CONFLICT spdk.crypto[0]" in out
    code, out = _run("apply", "--config", cfg, "--json")
    assert code == 1 and json.loads(out)["converged"] is False


def test_missing_config_file_is_a_clean_usage_error_not_an_errno() -> None:
    r = CliRunner().invoke(cli, ["spdk", "plan", "--config", "/nope.toml"])
    assert r.exit_code == 2 and "/nope.toml" in r.output and "does not exist" in r.output
    assert "[Errno" not in r.output and "Traceback" not in r.output
