"""[cluster] configuration: off by default (the single-node embedded default is unchanged),
environment overrides, per-tenant replicas, clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.config import ConfigError, load_config


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
