"""What a new user of dpuctl tripped over (issue 11): tracebacks for bad names, a refused second
agent hiding the first, read commands creating state in the wrong directory, markup eating
`[storage]`, raw numbers in tables, config values failing only at `agent run`, no way to see
what is cached, no confirmation before removing a tenant."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.config import load_config
from dpu_agent.testing import AgentProcess, spawn_agent
from dpu_agent.units import SizeError, format_duration, format_size, parse_size
from host_shim import KVClient
from kvproto.keys import ChunkLayout

REPO = Path(__file__).resolve().parents[1]
LAYOUT = ChunkLayout("cli", "float16", num_layers=1, num_kv_heads=1, head_dim=64, chunk_tokens=16)
# Variables that would point dpuctl at some agent: removed so a test says where it looks
_LOCATING = ("DPUKV_DATA_DIR", "DPUKV_AGENT_DATA_DIR", "DPUKV_CONFIG")


def run(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """dpuctl as a user runs it: its own process, main() (JSON usage errors live there)."""
    base = {k: v for k, v in os.environ.items() if k not in _LOCATING}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args],
        env={**base, "PYTHONPATH": str(REPO), **env}, cwd=cwd, capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("newcomer") / "var")
    yield a
    a.stop()


def at(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return run(*args, DPUKV_DATA_DIR=str(agent.data_dir))


@pytest.mark.parametrize("name", ["bad name/..", "", "Alice", "Bad!"])
@pytest.mark.parametrize("verb", ["add", "remove"])
def test_bad_tenant_name_is_a_usage_error_not_a_traceback(
    verb: str, name: str, tmp_path: Path
) -> None:
    r = run("tenants", verb, name, "--yes" if verb == "remove" else "--json", "--json",
            DPUKV_DATA_DIR=str(tmp_path))  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "[a-z0-9]" in doc["error"]


def test_usage_error_under_json_is_json() -> None:
    r = run("evict", "--tenant", "default", "10Q", "--json")
    assert r.returncode == 2
    assert "is not a size" in json.loads(r.stdout)["error"]


def test_refused_second_agent_keeps_the_running_agents_state_file(agent: AgentProcess) -> None:
    r = run("agent", "run", DPUKV_AGENT_DATA_DIR=str(agent.data_dir), DPUKV_CONTROL_PORT="0",
            DPUKV_NVMF_PORT="0", DPUKV_METRICS_PORT="0")  # fmt: skip
    assert r.returncode == 1 and "in use by another agent" in r.stderr, r.stderr
    state = json.loads((agent.data_dir / "agent.json").read_text())
    assert state["pid"] == agent.proc.pid
    assert at(agent, "status", "--json").returncode == 0


@pytest.mark.skipif(Path("/var/lib/dpukv").exists(), reason="an agent is installed here")
def test_read_commands_elsewhere_create_nothing_and_say_where_they_looked(tmp_path: Path) -> None:
    for args in (["status"], ["stats", "--json"], ["config", "show", "--json"]):
        r = run(*args, cwd=tmp_path)
        assert not (tmp_path / "var").exists(), args
    r = run("status", "--json", cwd=tmp_path)
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 3 and str(tmp_path / "var") in err and "/var/lib/dpukv" in err


def test_data_dir_variable_finds_the_agent_from_any_directory(
    agent: AgentProcess, tmp_path: Path
) -> None:
    r = run("status", "--json", cwd=tmp_path, DPUKV_DATA_DIR=str(agent.data_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["members"][0]["pid"] == agent.proc.pid
    assert not (tmp_path / "var").exists()


def test_error_message_keeps_bracketed_section_names(tmp_path: Path) -> None:
    bad = tmp_path / "agent.toml"
    bad.write_text('[storage]\ndram_bytes = "lots"\n')
    r = run("config", "show", "--config", str(bad))
    assert r.returncode == 4 and "[storage] dram_bytes" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ("[control]\nport = 70000\n", "[control] port"),
        ('[storage]\neviction_policy = "fifo"\n', "eviction_policy"),
        ('[agent]\nlog_level = "LOUD"\n', "log_level"),
        ("[storage]\nnvme_bytes = 0\n", "nvme_bytes"),
        ("[nvmf]\nio_workers = 0\n", "io_workers"),
        ("[agent]\ntick_interval_s = 0\n", "tick_interval_s"),
        ("[nvmf]\nmax_io_size = 1000\n", "max_io_size"),
        ("[storage]\nlease_ttl_s = 0\n", "lease_ttl_s"),
    ],
)
def test_config_value_failing_at_run_fails_at_load(tmp_path: Path, toml: str, names: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    r = CliRunner().invoke(cli, ["config", "show", "--json", "--config", str(path)])
    assert r.exit_code == 4, r.output
    assert names in json.loads(r.output)["error"]


def test_sizes_in_config_and_commands(agent: AgentProcess, tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[storage]\ndram_bytes = "512MiB"\nnvme_bytes = "10GiB"\n')
    cfg = load_config(path, environ={})
    assert (cfg.storage.dram_bytes, cfg.storage.nvme_bytes) == (512 << 20, 10 << 30)
    r = at(agent, "tenants", "add", "sized", "--quota", "1GiB", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    stats = json.loads(at(agent, "stats", "--json").stdout)["stats"]
    assert stats["tenants"]["sized"]["quota_bytes"] == 1 << 30
    assert at(agent, "evict", "--tenant", "sized", "1MiB", "--json").returncode == 0


def test_tables_show_sizes_and_durations_for_people(agent: AgentProcess) -> None:
    r = at(agent, "status")
    assert r.returncode == 0, r.stderr
    assert "GiB" in r.stdout
    assert re.search(r"uptime\s*\S\s*[\d.]+ s|uptime\s*\S\s*\d+m \d+s", r.stdout), r.stdout
    member = json.loads(at(agent, "status", "--json").stdout)["members"][0]
    assert str(member["capacity_bytes"]) not in r.stdout  # raw bytes only under --json


def test_tenant_removal_asks_for_yes_without_a_terminal(agent: AgentProcess) -> None:
    assert at(agent, "tenants", "add", "keepme", "--json").returncode == 0
    r = at(agent, "tenants", "remove", "keepme", "--json")
    assert r.returncode == 2 and "--yes" in json.loads(r.stdout)["error"]
    listed = json.loads(at(agent, "tenants", "list", "--json").stdout)["tenants"]
    assert "keepme" in [t["name"] for t in listed]
    assert at(agent, "tenants", "remove", "keepme", "--yes", "--json").returncode == 0


def test_chunks_ls_and_inspect_show_what_is_cached(agent: AgentProcess) -> None:
    tokens = list(range(4 * LAYOUT.chunk_tokens))
    data = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(4)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, salt=b"s" * 16) as c:
        assert c.put(tokens, data) == 4
        keys = [k.hex() for k in c.keys(tokens)]
    r = at(agent, "chunks", "ls", "--tenant", "default", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["chunks"]
    assert sorted(keys) == sorted(row["key"] for row in rows if row["key"] in keys)
    assert [row["key"] for row in rows] == sorted(row["key"] for row in rows)  # key order
    assert all(row["length_bytes"] == LAYOUT.chunk_bytes for row in rows if row["key"] in keys)
    first = json.loads(at(agent, "chunks", "ls", "--tenant", "default", "--limit", "2",
                          "--json").stdout)["chunks"]  # fmt: skip
    rest = json.loads(at(agent, "chunks", "ls", "--tenant", "default", "--after",
                         first[-1]["key"], "--json").stdout)["chunks"]  # fmt: skip
    assert [x["key"] for x in first + rest] == [x["key"] for x in rows]
    r = at(agent, "chunks", "inspect", "--tenant", "default", keys[2], "--json")
    chunk = json.loads(r.stdout)["chunk"]
    assert chunk["key"] == keys[2] and chunk["tier"] in ("dram", "nvme") and chunk["lba"] >= 0
    assert at(agent, "chunks", "inspect", "--tenant", "default", "zz", "--json").returncode == 2
    missing = at(agent, "chunks", "inspect", "--tenant", "default", "00" * 16, "--json")
    assert missing.returncode == 1 and "no chunk" in json.loads(missing.stdout)["error"]


def test_restore_lives_beside_backup() -> None:
    r = CliRunner().invoke(cli, ["backup", "--help"])
    assert "create" in r.output and "restore" in r.output
    assert CliRunner().invoke(cli, ["restore", "x"]).exit_code == 2  # no second way


def test_kvclient_put_with_fewer_chunks_than_the_tokens_make_raises() -> None:
    c = KVClient("tcp://127.0.0.1:9", "default", "t", LAYOUT, salt=b"s" * 16)
    try:
        with pytest.raises(ValueError, match="4 full chunks"):
            c.put(list(range(4 * 16)), [np.zeros(LAYOUT.chunk_shape, np.float16)])
        with pytest.raises(ValueError, match="split the call"):
            c.keys(list(range(4097 * 16)))
        assert len(c.keys(list(range(4096 * 16 + 5)))) == 4096
    finally:
        c.close()


def test_example_embedded_config_loads() -> None:
    cfg = load_config(REPO / "docs" / "examples" / "agent.toml", environ={})
    assert cfg.agent.mode == "embedded" and cfg.storage.dram_bytes > 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("10GiB", 10 << 30), ("10G", 10 << 30), ("512MiB", 512 << 20),
     ("2TB", 2 * 10**12), ("1.5KiB", 1536), ("7 B", 7)],
)  # fmt: skip
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


# 400 digits: float() of it is inf and the multiply raised OverflowError, a traceback in
# `dpuctl evict`, `tenants add --quota` and the config (found by an attack pass)
@pytest.mark.parametrize("text", ["", "x", "10Q", "3Ki", "-1", "1e3", "9" * 400, "9" * 400 + "GiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(SizeError):
        parse_size(text)


@pytest.mark.parametrize("args", [("backup", "create", ""), ("backup", "restore", "", "/x")])
def test_an_empty_backup_directory_is_refused(tmp_path: Path, args: tuple[str, ...]) -> None:
    """'' was the current directory: a backup landed wherever dpuctl ran (attack pass)."""
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2 and "an empty name" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_format_size_and_duration() -> None:
    assert format_size(2415919104) == "2.2 GiB" and format_size(100) == "100 B"
    assert format_duration(4.9) == "4.9 s" and format_duration(3725) == "1h 2m 5s"


def test_shell_completion_completes_commands() -> None:
    r = run(COMP_WORDS="dpuctl ch", COMP_CWORD="1", _DPUCTL_COMPLETE="bash_complete")
    assert r.returncode == 0 and "chunks" in r.stdout and "checkpoint" in r.stdout, r.stdout


def test_bench_without_the_bench_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import click

    from dpu_agent.cli import bench

    @click.command("needs-redis")
    def needs_redis() -> None:
        import redis  # noqa: F401

    monkeypatch.setitem(sys.modules, "redis", None)  # as on a DPU image: not installed
    monkeypatch.setitem(bench.commands, "needs-redis", needs_redis)
    r = CliRunner().invoke(cli, ["bench", "needs-redis"])
    assert r.exit_code == 1 and "dpu-kvtier[bench]" in r.output, r.output


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze "
                    "(apt-get install systemd)")  # fmt: skip
def test_agent_unit_for_the_embedded_default_passes_systemd_verify(tmp_path: Path) -> None:
    # not under /tmp or a home: the unit's PrivateTmp=yes and ProtectHome=yes would hide it
    # (dpuctl refuses such a path); a clone may itself lie under /tmp, so fall back to /run
    from dpu_agent.cli.ops import HIDDEN_FROM_UNIT

    def hidden(p: Path) -> bool:
        return any(p == Path(t) or Path(t) in p.parents for t in HIDDEN_FROM_UNIT)

    base = next((b for b in (REPO / "var", Path("/run"), Path("/srv"))
                 if not hidden(b.resolve()) and os.access(b.parent, os.W_OK)), None)  # fmt: skip
    if base is None:
        pytest.skip("no writable directory the unit's sandbox leaves visible (needs root)")
    bindir = base / f"dpukv-unit-test-{os.getpid()}-{tmp_path.name}"
    bindir.mkdir(parents=True)
    try:
        exe = bindir / "dpuctl"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        r = CliRunner().invoke(cli, ["agent", "unit", "--dpuctl", str(exe)])
        assert r.exit_code == 0, r.output
        unit = tmp_path / "dpukv-agent.service"
        unit.write_text(r.stdout)
        assert f"ExecStart={exe} agent run" in r.stdout and "Type=notify" in r.stdout
        check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert check.returncode == 0, check.stderr
    finally:
        shutil.rmtree(bindir)


@pytest.mark.parametrize("exe", ["/tmp/venv/bin/dpuctl", "/home/ops/.venv/bin/dpuctl",
                                 "/root/dpukv/.venv/bin/dpuctl"])  # fmt: skip
def test_agent_unit_refuses_an_executable_the_units_sandbox_hides(exe: str) -> None:
    r = CliRunner().invoke(cli, ["agent", "unit", "--dpuctl", exe])
    assert r.exit_code == 2, r.output
    assert "PrivateTmp=yes" in r.output and "/opt/dpukv/venv" in r.output
    assert "ExecStart" not in r.stdout  # no unit printed


def test_agent_unit_hint_does_not_install_the_loopback_example_as_the_production_config() -> None:
    r = CliRunner().invoke(cli, ["agent", "unit", "--dpuctl", "/opt/dpukv/venv/bin/dpuctl"])
    assert r.exit_code == 0, r.output
    assert "ExecStart=/opt/dpukv/venv/bin/dpuctl agent run" in r.stdout
    assert "docs/examples/agent.toml" not in r.stderr
    assert "dpu-production.toml" in r.stderr and "loopback" in r.stderr


def test_error_lines_are_not_hard_wrapped_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    r = run("status", DPUKV_DATA_DIR=str(tmp_path / "none"))  # no agent: a long error line
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) > 80, r.stderr


def test_metrics_port_conflict_names_the_port_and_a_failed_start_logs_no_stop(
    tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run("agent", "run", DPUKV_AGENT_DATA_DIR=str(tmp_path), DPUKV_CONTROL_PORT="0",
                DPUKV_NVMF_PORT="0", DPUKV_METRICS_PORT=str(port))  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"[metrics] 127.0.0.1:{port}" in r.stderr, r.stderr
    after = r.stderr[r.stderr.index("cannot start the agent") :]
    assert "agent_stopped" not in after, r.stderr


def test_provision_with_a_missing_bfb_fails_before_any_progress_bar(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text("")
    r = run("provision", "--config", str(cfg), "--bfb", str(tmp_path / "missing.bfb"),
            "--rshim", "rshim0")  # fmt: skip
    assert r.returncode == 2 and "missing.bfb" in r.stderr and "does not exist" in r.stderr
    assert "bfb-install" not in r.stderr and "%" not in r.stderr, r.stderr


def test_chunks_ls_stopping_at_its_limit_prints_the_total_and_an_after_hint(
    agent: AgentProcess,
) -> None:
    tokens = list(range(1000, 1000 + 3 * LAYOUT.chunk_tokens))
    data = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(3)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, salt=b"t" * 16) as c:
        assert c.put(tokens, data) == 3
    doc = json.loads(at(agent, "chunks", "ls", "--tenant", "default", "--json").stdout)
    total = doc["total"]
    assert total == len(doc["chunks"]) >= 3 and doc["next_after"] is None
    r = at(agent, "chunks", "ls", "--tenant", "default", "--limit", "2")
    assert r.returncode == 0, r.stderr
    page = json.loads(at(agent, "chunks", "ls", "--tenant", "default", "--limit", "2",
                         "--json").stdout)  # fmt: skip
    assert page["next_after"] == page["chunks"][-1]["key"]
    assert f"2 shown of {total}" in r.stdout
    assert f"--after {page['next_after']}" in r.stdout
    last = at(agent, "chunks", "ls", "--tenant", "default", "--limit", str(total))
    assert "--after" not in last.stdout  # everything shown: no hint
