"""Agent configuration: defaults, TOML, DPUKV_* overrides, generated 0600 secrets, redaction."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dpu_agent.config import ConfigError, load_config


def test_defaults_are_the_embedded_mode(tmp_path: Path) -> None:
    cfg = load_config(environ={})
    assert cfg.control.port == 7400 and cfg.nvmf.port == 4420 and cfg.metrics.port == 9400
    assert cfg.control.host == cfg.nvmf.host == cfg.metrics.host == "127.0.0.1"
    assert cfg.agent.data_dir == "./var"


def test_prepare_generates_0600_tokens_once(tmp_path: Path) -> None:
    cfg = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path / "var")})
    cfg.prepare()
    token_file = tmp_path / "var" / "tenant-default.token"
    admin_file = tmp_path / "var" / "admin.token"
    for f in (token_file, admin_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert cfg.tenants["default"].token == token_file.read_text().strip()
    again = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path / "var")})
    again.prepare()
    assert again.tenants["default"].token == cfg.tenants["default"].token
    assert again.admin_token == cfg.admin_token != cfg.tenants["default"].token


def test_toml_then_env_override(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        "[control]\nport = 7500\n[storage]\ndram_bytes = 8388608\n"
        '[tenants.acme]\ntoken = "s3cret-acme-0123456789"\nquota_bytes = 4096\n'
    )
    cfg = load_config(f, environ={"DPUKV_CONTROL_PORT": "7600", "DPUKV_METRICS_ENABLED": "false"})
    assert cfg.control.port == 7600
    assert cfg.storage.dram_bytes == 8 << 20
    assert cfg.metrics.enabled is False
    assert (
        cfg.tenants["acme"].token == "s3cret-acme-0123456789"
        and cfg.tenants["acme"].quota_bytes == 4096
    )


def test_redacted_hides_every_secret(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        f'[agent]\ndata_dir = "{tmp_path}"\n[tenants.acme]\ntoken = "s3cret-acme-0123456789"\n'
    )
    cfg = load_config(f, environ={})
    cfg.prepare()
    text = json.dumps(cfg.redacted())
    assert "s3cret-acme-0123456789" not in text and cfg.admin_token not in text
    assert cfg.redacted()["tenants"]["acme"]["token"] == "<redacted>"
    assert "s3cret" not in repr(cfg)


@pytest.mark.parametrize(
    ("toml", "env", "match"),
    [
        ("[control]\nprot = 1\n", {}, "unknown key"),
        ("[nope]\nx = 1\n", {}, "unknown section"),
        ("[control]\nport = 'x'\n", {}, "must be a int"),
        ("[tenants.Bad_Name]\ntoken = 'x'\n", {}, "tenant name"),
        ("", {"DPUKV_CONTROL_PORT": "-1"}, "negative"),
        ("", {"DPUKV_STORAGE_LEASE_TTL_S": "nan"}, "finite"),  # it started, leases broken
        ("[storage]\nlease_ttl_s = nan\n", {}, "finite"),
        ("[storage]\npolicy_order_save_s = inf\n", {}, "finite"),
        ("", {"DPUKV_STORAGE_POLICY_ORDER_SAVE_S": "0"}, "policy_order_save_s"),
        ("", {"DPUKV_STORAGE_POLICY_ORDER_SAVE_S": "0.001"}, "at least 1"),
        ("", {"DPUKV_METRICS_ENABLED": "maybe"}, "boolean"),
        ("[control\n", {}, "not valid TOML"),
        # found by an attack pass: each passed `config check` or became another value
        ("[control]\nport = true\n", {}, "not true/false"),  # was port 1
        ("[metrics]\nport = 3.9\n", {}, "whole number"),  # was port 3
        ("[agent]\ntick_interval_s = true\n", {}, "not true/false"),  # was 1.0
        ("[storage]\nnvme_bytes = 4097\n", {}, "multiple of 4096"),  # failed at agent run
        ("[storage]\ndram_bytes = 1e300\n", {}, "out of range"),  # OverflowError at run
        ("[storage]\ndram_bytes = '" + "9" * 400 + "'\n", {}, "out of range"),  # traceback
        ("", {"DPUKV_STORAGE_DRAM_BYTES": "9" * 400}, "out of range"),  # traceback
        ('[agent]\ndata_dir = "/tmp/x\\u0000y"\n', {}, "NUL"),  # traceback at mkdir
        # the value's origin, not the whole configuration's (it said "<defaults>:", the file)
        ("", {"DPUKV_CONTROL_PORT": "99999"}, "^environment DPUKV_CONTROL_PORT: .*port=99999"),
        ("[agent]\nnode_name = 'n1'\n", {"DPUKV_CLUSTER_REPLICAS": "0"}, "^environment DPUKV_CL"),
        ("[control]\nport = 70000\n", {}, "agent.toml: \\[control\\] port=70000"),
        ("control = 5\n", {}, "control must be a table"),  # it said "unknown section"
    ],
)
def test_bad_config_says_what_and_where(tmp_path: Path, toml: str, env: dict, match: str) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_config(f, environ=env)


@pytest.mark.parametrize(
    ("where", "token", "says"),
    [
        ("tenant-default.token", "x", "at least 16 characters .it has 1."),
        ("admin.token", "short-admin", "admin_token_file"),
        ("inline", "abcdefgh ijklmnopq", "without spaces"),
    ],
)
def test_guessable_token_refused_at_start(
    tmp_path: Path, where: str, token: str, says: str
) -> None:
    """A 1-character tenant token was served: anyone could guess it and read the tenant's data.
    The agent's start refuses it naming the file; read-only commands still load."""
    f = tmp_path / "agent.toml"
    f.write_text(f'[agent]\ndata_dir = "{tmp_path}"\n')
    if where == "inline":
        f.write_text(f'[agent]\ndata_dir = "{tmp_path}"\n[tenants.acme]\ntoken = "{token}"\n')
    else:
        (tmp_path / where).write_text(token + "\n")
        (tmp_path / where).chmod(0o600)
    with pytest.raises(ConfigError, match=says):
        load_config(f, environ={}).prepare()
    load_config(f, environ={}).prepare(create=False)  # dpuctl talking to a running agent


def test_a_token_of_the_largest_size_loads_with_its_line_end(tmp_path: Path) -> None:
    """A 4,096-byte token was taken at run time, written with its "\n", then refused at the
    next start as "over 4096 bytes" (a re-attack pass)."""
    from dpu_agent.config import read_secret

    f = tmp_path / "t.token"
    for text in ("a" * 4096 + "\n", "a" * 4096 + "\r\n", "a" * 4096):
        f.write_text(text, newline="")
        f.chmod(0o600)
        assert read_secret(f) == "a" * 4096
    f.write_text("a" * 4097 + "\n")
    with pytest.raises(ConfigError, match="over 4096 bytes"):
        read_secret(f)


def test_group_readable_token_refused(tmp_path: Path) -> None:
    cfg = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path)})
    cfg.prepare()
    os.chmod(tmp_path / "admin.token", 0o644)
    cfg2 = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path)})
    with pytest.raises(ConfigError, match="chmod 600"):
        cfg2.prepare()


@pytest.mark.parametrize(
    ("damage", "says"),
    [(b"\xff\xfeq\x80token", "not text"), (b"\0" * 44, "control characters")],
    ids=["not-utf8", "zeroed"],
)
def test_a_damaged_secret_file_is_refused_naming_it(
    tmp_path: Path, damage: bytes, says: str
) -> None:
    """A flipped bit made the start die with a UnicodeDecodeError traceback; a zeroed admin
    token was taken, and forty-four NULs logged in as the admin."""
    cfg = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path)})
    cfg.prepare()
    for name in ("admin.token", "tenant-default.token"):
        f = tmp_path / name
        saved = f.read_bytes()
        f.write_bytes(damage)
        again = load_config(environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path)})
        with pytest.raises(ConfigError, match=f"secret file {f} .*{says}"):
            again.prepare()
        f.write_bytes(saved)


def test_nixl_prestart_is_off_by_default_and_set_by_file_or_environment(tmp_path: Path) -> None:
    assert load_config(environ={}).nixl.prestart is False
    f = tmp_path / "agent.toml"
    f.write_text("[nixl]\nprestart = true\n")
    assert load_config(f, environ={}).nixl.prestart is True
    assert load_config(f, environ={"DPUKV_NIXL_PRESTART": "false"}).nixl.prestart is False
    with pytest.raises(ConfigError, match="prestart"):
        load_config(environ={"DPUKV_NIXL_PRESTART": "sometimes"})


@pytest.mark.parametrize("key", ["DATA_DIR", "ADMIN_TOKEN_FILE", "STATE_FILE"])
def test_an_empty_agent_path_is_a_config_error(tmp_path: Path, key: str) -> None:
    """DPUKV_AGENT_DATA_DIR= made the working directory the data directory (made 0700 and
    filled with keys, journal and tokens); an empty admin_token_file or state_file named the
    data directory itself."""
    with pytest.raises(ConfigError, match=rf"\[agent\] {key.lower()}='' is empty"):
        load_config(environ={"DPUKV_DATA_DIR": str(tmp_path), f"DPUKV_AGENT_{key}": ""})


def test_a_config_error_does_not_echo_a_token(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('[tenants.acme]\ntoken = "s3cret\\u0000tail"\n')
    with pytest.raises(ConfigError) as e:
        load_config(f, environ={})
    assert "s3cret" not in str(e.value) and "token=<redacted>" in str(e.value)


def test_a_data_dir_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "var").write_text("not a directory")
    cfg = load_config(environ={"DPUKV_DATA_DIR": str(tmp_path / "var")})
    with pytest.raises(ConfigError, match=r"\[agent\] data_dir .*var is not a directory"):
        cfg.prepare()
