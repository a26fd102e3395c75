"""The service split by mode: dpu_agent.service asks a DataPlane and never looks at the mode;
admin ops go through one table; the SPDK plane refuses what SPDK owns with the same replies as
before, without SPDK running (nothing here starts a peer: the refusals come before any I/O).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from dpu_agent.config import AgentConfig, load_config
from dpu_agent.control import Dispatcher, TenantRegistry
from dpu_agent.dataplane import DataPlane, EmbeddedDataPlane, SpdkDataPlane, data_plane
from dpu_agent.service import Agent, banner
from kvproto.control import ADMIN_OPS, NIXL_OPS, OPS

ROOT = Path(__file__).resolve().parents[1]
SPDK_EXAMPLE = ROOT / "spdk_plugins/examples/agent-spdk.toml"


def _spdk_cfg(tmp_path: Path) -> AgentConfig:
    cfg = load_config(SPDK_EXAMPLE, environ={})
    cfg.agent.data_dir = str(tmp_path / "var")
    cfg.prepare()
    return cfg


def _embedded_cfg(tmp_path: Path) -> AgentConfig:
    cfg = load_config(None, environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path / "var")})
    cfg.prepare()
    return cfg


def test_service_has_no_mode_branch() -> None:
    """Every embedded-vs-SPDK choice is the DataPlane's: service.py names no mode, no SPDK
    module and no target of its own."""
    source = (ROOT / "dpu_agent/service.py").read_text()
    for word in ("spdk_mode", "mode ==", "cfg.spdk", "listener_for", "NvmeTcpTarget"):
        assert word not in source, f"dpu_agent/service.py still says {word!r}"
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in imported if "spdk" in m or m.startswith("dpu_agent.nvmf")}, imported


def test_every_protocol_op_has_exactly_one_handler() -> None:
    """kvproto's ops are answered by the dispatcher's table, the NIXL path or the agent's
    admin table: each by one of them, none by none (an op nobody answers would reach the
    agent's `no handler` assertion and stop the agent)."""
    dispatcher = Dispatcher(backend=None, registry=TenantRegistry("admin-token", {}))  # type: ignore[arg-type]
    sync = set(dispatcher._sync)
    admin = set(Agent.ADMIN_OPS)
    session = {"hello", "peer_challenge"}
    groups = [sync, admin, set(NIXL_OPS), session]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "an op has two handlers"
    assert set().union(*groups) == set(OPS)
    assert admin <= ADMIN_OPS  # admin sessions only
    assert all(inspect.iscoroutinefunction(h) for h in Agent.ADMIN_OPS.values())


def test_data_plane_follows_the_configured_mode(tmp_path: Path) -> None:
    embedded = data_plane(_embedded_cfg(tmp_path / "e"))
    spdk = data_plane(_spdk_cfg(tmp_path / "s"))
    assert isinstance(embedded, EmbeddedDataPlane) and isinstance(spdk, SpdkDataPlane)
    members = [n for n in dir(DataPlane) if not n.startswith("_")] + ["offers_nixl"]
    for plane in (embedded, spdk):
        missing = [n for n in members if not hasattr(plane, n)]
        assert not missing, f"{type(plane).__name__} lacks {missing}"


def _admin(agent: Agent, op: str, **fields: Any) -> dict[str, Any]:
    return asyncio.run(agent.admin(op, fields))


def test_spdk_mode_refuses_what_spdk_owns_with_its_reasons(tmp_path: Path) -> None:
    """Hosts, new tenants and backups are [spdk]'s in SPDK mode: each admin op says so and
    changes nothing (no token file for the refused tenant, tenants.json untouched)."""
    cfg = _spdk_cfg(tmp_path)
    agent = Agent(cfg)
    with pytest.raises(ValueError, match=r"hosts and their keys are \[spdk\]'s"):
        _admin(agent, "host_add", tenant="a", nqn="nqn.2014-08.org.example:h1")
    with pytest.raises(ValueError, match=r"hosts and their keys are \[spdk\]'s"):
        _admin(agent, "host_list", tenant="a")
    with pytest.raises(ValueError, match=r"hosts and their keys are \[spdk\]'s"):
        _admin(agent, "host_remove", tenant="a", nqn="nqn.2014-08.org.example:h1")
    with pytest.raises(LookupError, match="no tenant 'zz'"):  # the tenant check comes first
        _admin(agent, "host_list", tenant="zz")
    with pytest.raises(ValueError, match=r"SPDK mode: add tenant 'b' to \[tenants\]"):
        _admin(agent, "tenant_add", tenant="b", token=None, quota_bytes=0)
    for op, fields in (("backup", {"dir": str(tmp_path / "b"), "incremental": False}),
                       ("restore", {"dirs": [str(tmp_path / "b")], "mode": None})):  # fmt: skip
        with pytest.raises(ValueError, match=f"{op} is not available in SPDK mode"):
            _admin(agent, op, **fields)
    assert not (tmp_path / "var/tenant-b.token").exists()
    assert not (tmp_path / "var/tenants.json").exists()
    assert list(cfg.tenants) == ["a"]


def test_spdk_plane_points_hosts_at_spdks_listener(tmp_path: Path) -> None:
    cfg = _spdk_cfg(tmp_path)
    agent = Agent(cfg)
    plane = agent.dataplane
    assert plane.address() == "192.0.2.10:4420"
    nvme = plane.hello_nvme("a", "nqn.2014-08.org.example:h1", "192.0.2.10")
    assert nvme["host"] == "192.0.2.10" and nvme["port"] == 4420
    assert nvme["subnqn"] == plane.subsystem_nqn("a")
    assert plane.unconfigured({"a", "old"}, {"a"}) == []  # SPDK's lvols are [spdk]'s
    addr = {"control_tcp": "tcp://192.0.2.10:7400", "control_unix": "", "nvmf": plane.address(),
            "metrics": ""}  # fmt: skip
    assert f"(subsystem {plane.subsystem_nqn('a')})" in banner(cfg, addr, plane)


def test_banner_names_where_the_token_is(tmp_path: Path) -> None:
    """With the token inline in the config file the banner said "token in <data dir>" and its
    example opened the data directory as a file."""
    conf = tmp_path / "agent.toml"
    conf.write_text('[tenants.acme]\ntoken = "acme-inline-token-0123456789"\n')
    cfg = load_config(conf, environ={"DPUKV_AGENT_DATA_DIR": str(tmp_path / "var")})
    cfg.prepare()
    addr = {"control_tcp": "tcp://127.0.0.1:7400", "control_unix": "", "nvmf": "", "metrics": ""}
    text = banner(cfg, addr, data_plane(cfg))
    assert f"token in {conf} ([tenants.acme] token)" in text and "open(" not in text
    plain = _embedded_cfg(tmp_path / "b")
    text = banner(plain, addr, data_plane(plain))
    token_file = tmp_path / "b" / "var" / "tenant-default.token"
    assert f"token in {token_file}" in text and f'open("{token_file}")' in text


def test_embedded_plane_erases_unconfigured_tenants_only(tmp_path: Path) -> None:
    plane = data_plane(_embedded_cfg(tmp_path))
    assert plane.unconfigured({"default", "old", "gone"}, {"default"}) == ["gone", "old"]
    plane.check_addable("b")  # its tiers are the agent's own: nothing to refuse
    plane.check_backup("backup")
