"""[cluster] configuration: off by default (the single-node embedded default is unchanged),
environment overrides, per-tenant replicas, clear errors for bad values."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from dpu_agent.config import AgentConfig, ConfigError, load_config


def test_off_by_default_and_env_overrides() -> None:
    cfg = load_config(None, environ={})
    assert cfg.cluster.enabled is False and cfg.cluster.replicas == 1
    cfg = load_config(None, environ={"DPUKV_CLUSTER_ENABLED": "1",
                                     "DPUKV_CLUSTER_JOIN": "10.0.0.2:7946,10.0.0.3:7946",
                                     "DPUKV_CLUSTER_REPLICAS": "3"})  # fmt: skip
    assert cfg.cluster.enabled and cfg.cluster.replicas == 3
    assert cfg.cluster.join == "10.0.0.2:7946,10.0.0.3:7946"


def test_tenant_replicas_and_bad_values(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[cluster]\nenabled = true\nzone = "r1"\n[tenants.acme]\nreplicas = 2\n')
    cfg = load_config(good, environ={})
    assert cfg.tenants["acme"].replicas == 2 and cfg.cluster.zone == "r1"
    for text, match in [
        ("[cluster]\nreplicas = 0\n", "replicas=0 must be 1..8"),
        ("[cluster]\nreplicas = 9\n", "replicas=9 must be 1..8"),
        ("[tenants.acme]\nreplicas = 12\n", r"\[tenants.acme\] replicas=12"),
        ('[cluster]\nserf_profile = "fast"\n', "lan, wan or local"),
        ("[cluster]\nbogus = 1\n", "unknown key \\[cluster\\] bogus"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_config(bad, environ={})


def _cluster_cfg(tmp_path: Path, **env: str) -> AgentConfig:
    return load_config(None, environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path / "d"),
                                      "DPUKV_CLUSTER_ENABLED": "1", **env})  # fmt: skip


def _secret(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def test_cluster_secrets_generated_required_and_group_readable_refused(tmp_path: Path) -> None:
    """Regression: no Serf RPC key by default, and a world-readable rpc_auth_file was
    accepted (every other secret file is refused when group/world-readable)."""
    d = tmp_path / "d"
    with pytest.raises(ConfigError, match=r"keyring_file .* is missing"):
        _cluster_cfg(tmp_path).prepare()
    _secret(d / "serf-keyring.json", json.dumps([base64.b64encode(b"k" * 32).decode()]))
    with pytest.raises(ConfigError, match=r"peer_key_file .* is missing"):
        _cluster_cfg(tmp_path).prepare()
    _secret(d / "cluster-peer.key", "p" * 44 + "\n")
    cfg = _cluster_cfg(tmp_path)
    cfg.prepare()
    rpc = d / "serf-rpc.key"
    assert rpc.stat().st_mode & 0o777 == 0o600 and len(cfg.serf_rpc_key) >= 32
    assert cfg.peer_keys == (b"p" * 44,)
    assert "serf_rpc_key" not in json.dumps(cfg.redacted()) and "ppp" not in str(cfg)
    for path in (rpc, d / "serf-keyring.json", d / "cluster-peer.key"):
        path.chmod(0o644)
        with pytest.raises(ConfigError, match="chmod 600"):
            _cluster_cfg(tmp_path).prepare()
        path.chmod(0o600)
    own = tmp_path / "operator-serf.key"  # an operator-run Serf: the key must be there
    cfg = _cluster_cfg(tmp_path, DPUKV_CLUSTER_SERF_START="0",
                       DPUKV_CLUSTER_RPC_AUTH_FILE=str(own))  # fmt: skip
    with pytest.raises(ConfigError, match="operator-run"):
        cfg.prepare()
    _secret(own, "operator-key\n", 0o604)
    with pytest.raises(ConfigError, match="chmod 600"):
        _cluster_cfg(tmp_path, DPUKV_CLUSTER_SERF_START="0",
                     DPUKV_CLUSTER_RPC_AUTH_FILE=str(own)).prepare()  # fmt: skip


def test_bad_keyrings_and_peer_keys_are_refused_with_the_reason(tmp_path: Path) -> None:
    d = tmp_path / "d"
    _secret(d / "cluster-peer.key", "p" * 44 + "\n")
    for text, match in [
        ("not json", "not JSON"),
        ("[]", "list of 1 to 8 keys"),
        ('["@@@"]', "not base64"),
        (json.dumps([base64.b64encode(b"k" * 20).decode()]), "20 bytes"),
    ]:
        _secret(d / "serf-keyring.json", text)
        with pytest.raises(ConfigError, match=match):
            _cluster_cfg(tmp_path).prepare()
    _secret(d / "serf-keyring.json", json.dumps([base64.b64encode(b"k" * 16).decode()]))
    for text, match in [("short\n", "shorter than 32"), ("# only a comment\n", "no key")]:
        _secret(d / "cluster-peer.key", text)
        with pytest.raises(ConfigError, match=match):
            _cluster_cfg(tmp_path).prepare()
