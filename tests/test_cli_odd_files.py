"""Files a user names that are not what they should be: a FIFO in place of a config, token,
credentials or output file held dpuctl (and the agent's start) for good; a directory as a
token file got "chmod 600 /etc" as advice; a missing output directory raised a traceback.
Each is now one line and an exit code, at once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(60)  # a FIFO that blocks fails the test, not the suite


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


def _config(tmp_path: Path, token: Path) -> Path:
    conf = tmp_path / "a.toml"
    data = tmp_path / "var"
    conf.write_text(f'[agent]\ndata_dir = "{data}"\n[tenants.a]\ntoken_file = "{token}"\n')
    return conf


def test_a_fifo_as_the_config_file(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["config", "show", "--config", str(_fifo(tmp_path / "a.toml"))])
    assert r.exit_code == 4 and "not a regular file" in r.output, r.output


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_token_file_that_is_no_file(tmp_path: Path, kind: str) -> None:
    token = tmp_path / "t.token"
    if kind == "fifo":
        _fifo(token)
    else:
        token.mkdir(mode=0o755)
    conf = tmp_path / "a.toml"
    conf.write_text(
        f'[agent]\ndata_dir = "{tmp_path / "var"}"\n[tenants.a]\ntoken_file = "{token}"\n'
    )
    cfg = load_config(conf, environ={})
    with pytest.raises(ConfigError, match=f"secret file {token} is not a regular file"):
        cfg.prepare(create=False)


def test_an_oversized_token_file(tmp_path: Path) -> None:
    token = tmp_path / "t.token"
    token.write_text("x" * 50_000)
    token.chmod(0o600)
    conf = tmp_path / "a.toml"
    conf.write_text(
        f'[agent]\ndata_dir = "{tmp_path / "var"}"\n[tenants.a]\ntoken_file = "{token}"\n'
    )
    with pytest.raises(ConfigError, match="is over 4096 bytes"):
        load_config(conf, environ={}).prepare(create=False)


def test_hosts_enrol_to_a_fifo_or_a_missing_directory(tmp_path: Path) -> None:
    data = tmp_path / "var"
    env = {"DPUKV_AGENT_DATA_DIR": str(data)}
    assert CliRunner().invoke(cli, ["config", "show"], env=env).exit_code == 0
    load_config(environ=env).prepare()  # tokens, as an agent's start makes them
    for out, says in ((_fifo(tmp_path / "out.json"), "cannot write"),
                      (tmp_path / "nope" / "x.json", "cannot write")):  # fmt: skip
        r = CliRunner().invoke(
            cli, ["hosts", "enrol", "--tenant", "default", "--out", str(out), "--json"], env=env
        )
        assert r.exit_code == 2 and says in json.loads(r.output)["error"], r.output


def test_connect_config_from_a_fifo(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli, ["hosts", "connect-config", "--credentials", str(_fifo(tmp_path / "c.json"))]
    )
    assert r.exit_code == 2 and "not a regular file" in r.output, r.output


def test_a_start_that_fails_for_a_missing_file_does_not_blame_the_ports(tmp_path: Path) -> None:
    """Every OSError at start said "Is another agent running? Ports: ..." (a missing tls_cert
    too, naming neither the file nor the setting)."""
    import subprocess
    import sys

    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(tmp_path / "var"),
           "DPUKV_CONTROL_PORT": "0", "DPUKV_NVMF_PORT": "0", "DPUKV_METRICS_PORT": "0",
           "DPUKV_CONTROL_TLS_CERT": str(tmp_path / "nope.pem"),
           "DPUKV_CONTROL_TLS_KEY": str(tmp_path / "nope.key")}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", "from dpu_agent.cli import main; main()", "agent",
                        "run"], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "tls_cert" in error[0] and "nope.pem" in error[0], r.stderr
    assert "another agent" not in error[0]
