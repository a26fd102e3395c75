"""`dpuctl hosts connect-config`: the keys a kernel initiator gets are in nvme-cli's formats
(its own `check-dhchap-key` / `check-tls-key` accept them and refuse a corrupted one), and the
`nvme connect` line and config.json are accepted by nvme-cli up to where it needs the kernel's
nvme-fabrics (this machine has none: nvme-cli's refusal is checked)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.testing import AgentProcess, spawn_agent

NVME = shutil.which("nvme")
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f6e1a2b-0000-4000-8000-000000000001"
pytestmark = pytest.mark.skipif(NVME is None, reason="nvme-cli is not installed (nvme)")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    env = {"DPUKV_NVMF_REQUIRE_AUTH": "true", "DPUKV_NVMF_SECURE_CHANNEL": "true"}
    a = spawn_agent(tmp_path_factory.mktemp("kconn") / "var", env=env)
    yield a
    a.stop()


def _nvme(*args: str) -> subprocess.CompletedProcess[str]:
    assert NVME is not None
    return subprocess.run(
        [NVME, *args], capture_output=True, text=True, timeout=30, check=False
    )  # fmt: skip


@pytest.fixture(scope="module")
def enrolled(agent: AgentProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("creds") / "gpu1.json"
    r = CliRunner().invoke(
        cli,
        ["hosts", "enrol", "--tenant", "default", "--nqn", HOSTNQN, "--out", str(out)],
        env={"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)},
    )
    assert r.exit_code == 0, r.output
    return out


def test_issued_keys_pass_nvme_clis_own_key_checks(enrolled: Path) -> None:
    creds = json.loads(enrolled.read_text())
    assert creds["dhchap_key"].startswith("DHHC-1:") and creds["psk"].startswith("NVMeTLSkey-1:")
    ok = _nvme("check-dhchap-key", f"--key={creds['dhchap_key']}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ok = _nvme("check-tls-key", f"--key={creds['psk']}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # the checks are real: one changed character breaks each key's CRC
    bad = creds["dhchap_key"][:12] + ("A" if creds["dhchap_key"][12] != "A" else "B")
    assert _nvme("check-dhchap-key", f"--key={bad}{creds['dhchap_key'][13:]}").returncode != 0
    bad = creds["psk"][:20] + ("A" if creds["psk"][20] != "A" else "B")
    assert _nvme("check-tls-key", f"--key={bad}{creds['psk'][21:]}").returncode != 0


def test_connect_line_and_config_json_reach_nvme_clis_fabrics_refusal(
    enrolled: Path, tmp_path: Path
) -> None:
    if os.path.exists("/dev/nvme-fabrics"):
        pytest.skip("this kernel has nvme-fabrics: the test would connect for real")
    config, discovery = tmp_path / "config.json", tmp_path / "discovery.conf"
    r = CliRunner().invoke(
        cli,
        ["hosts", "connect-config", "--credentials", str(enrolled),
         "--config-out", str(config), "--discovery-out", str(discovery)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.strip())
    creds = json.loads(enrolled.read_text())
    assert argv[:2] == ["nvme", "connect"] and f"--dhchap-secret={creds['dhchap_key']}" in argv
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    host = json.loads(config.read_text())[0]
    assert host["hostnqn"] == HOSTNQN and host["dhchap_key"] == creds["dhchap_key"]
    assert host["subsystems"][0]["ports"][0]["tls_key"] == creds["psk"]
    assert "--nqn=" not in discovery.read_text()  # discovery.conf entries name no subsystem
    args = argv[2:]
    if "--tls" not in _nvme("connect", "--help").stdout + _nvme("connect", "--help").stderr:
        args = [a for a in args if not a.startswith(("--tls", "--tls_key"))]  # nvme-cli < 2.5
    for run in (_nvme("connect", *args), _nvme("connect-all", f"--config={config}")):
        out = run.stdout + run.stderr
        assert run.returncode != 0
        assert "unrecognized option" not in out and "Invalid" not in out, out
        assert "nvme-fabrics" in out or "scan topology" in out, out


def test_connect_config_of_a_host_enrolled_without_nqn_says_so(
    agent: AgentProcess, tmp_path: Path
) -> None:
    out = tmp_path / "plain.json"
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    assert (
        CliRunner()
        .invoke(cli, ["hosts", "enrol", "--tenant", "default", "--out", str(out)], env=env)
        .exit_code
        == 0
    )
    r = CliRunner().invoke(cli, ["hosts", "connect-config", "--credentials", str(out)])
    assert r.exit_code == 2 and "enrol the host with --nqn" in r.output
