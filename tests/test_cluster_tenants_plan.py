"""The cluster-tenant reconcile plan (pure): what a node erases, adds, re-keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agent.cluster import TenantRecord, plan_tenants
from dpu_agent.config import ConfigError, load_config
from dpu_agent.testing import spawn_agent


def rec(name: str, inc: str = "i1", token: str = "t1", quota: int = 0) -> TenantRecord:
    return TenantRecord(name=name, token=token, incarnation=inc, quota_bytes=quota)


def kinds(steps: list) -> list[tuple[str, str]]:
    return [(s.kind, s.name) for s in steps]


def test_plan_erases_what_etcd_lost_and_readds_a_new_incarnation_empty() -> None:
    desired = {"a": rec("a"), "b": rec("b", inc="i2"), "c": rec("c", token="t2", quota=5)}
    steps = plan_tenants(
        desired,
        static={"default"},
        known={"a": "i1", "b": "i1", "c": "i1", "gone": "i1"},
        served={"a": ("t1", 0), "b": ("t1", 0), "c": ("t1", 0), "gone": ("t1", 0)},
        engine={"default", "a", "b", "c", "gone", "stray"},
    )
    assert kinds(steps) == [
        ("erase", "b"), ("erase", "gone"), ("erase", "stray"),
        ("add", "b"), ("token", "c"), ("quota", "c"),
    ]  # fmt: skip


def test_plan_at_restart_serves_known_incarnation_and_never_touches_config_tenants() -> None:
    steps = plan_tenants(
        {"a": rec("a"), "default": rec("default")},
        static={"default"},
        known={"a": "i1"},
        served={},
        engine={"a", "default"},
    )
    assert kinds(steps) == [("add", "a")]  # kept data, not erased; "default" is the config's
    assert kinds(plan_tenants({}, static=set(), known={}, served={}, engine={"x"})) == [
        ("erase", "x")
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ENDPOINTS": "etcd:2379"}, "must be http"),
        ({"ENDPOINTS": "http://127.0.0.1:2379"}, "needs etcd_user and etcd_password_file"),
        ({"ENDPOINTS": "http://127.0.0.1:2379", "USER": "u", "PASSWORD_FILE": "p",
          "CERT_FILE": "c.pem"}, "go together"),
        ({"ENDPOINTS": "http://127.0.0.1:2379", "USER": "u", "PASSWORD_FILE": "p",
          "PREFIX": "dpukv"}, "must be /NAME"),
    ],
)  # fmt: skip
def test_etcd_config_refused_without_credentials_or_with_bad_values(
    env: dict[str, str], message: str
) -> None:
    environ = {f"DPUKV_CLUSTER_ETCD_{k}": v for k, v in env.items()}
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_agent_refuses_a_readable_etcd_password_file(tmp_path: Path) -> None:
    pw = tmp_path / "etcd.password"
    pw.write_text("secret\n")
    pw.chmod(0o644)
    env = {
        "DPUKV_CLUSTER_ETCD_ENDPOINTS": "http://127.0.0.1:9",
        "DPUKV_CLUSTER_ETCD_USER": "dpukv",
        "DPUKV_CLUSTER_ETCD_PASSWORD_FILE": str(pw),
        "DPUKV_METRICS_ENABLED": "0",
    }
    with pytest.raises(RuntimeError, match="chmod 600"):
        spawn_agent(tmp_path / "var", env=env)
