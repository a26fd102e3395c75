"""dpuctl operator commands: --json output, exit codes (0 ok, 1 failed, 2 usage, 3 unreachable,
4 bad config), against a real agent child where one is needed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli, ops
from dpu_agent.testing import AgentProcess, spawn_agent


def dpuctl(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data_dir)}
    return subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("cli") / "var")
    yield a
    a.stop()


def _admin_token(data_dir: Path) -> None:
    """What a started agent leaves: an admin token (0600)."""
    (data_dir / "admin.token").write_text("t0ken-0123456789abcdef\n")
    (data_dir / "admin.token").chmod(0o600)


def test_config_show_json_is_redacted(tmp_path: Path) -> None:
    (tmp_path / "tenant-default.token").write_text("s3cret-token-0123456789\n")
    (tmp_path / "tenant-default.token").chmod(0o600)
    _admin_token(tmp_path)
    r = CliRunner().invoke(
        cli, ["config", "show", "--json"], env={"DPUKV_AGENT_DATA_DIR": str(tmp_path)}
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    token = (tmp_path / "tenant-default.token").read_text().strip()
    assert token not in r.output and doc["tenants"]["default"]["token"] == "<redacted>"
    assert doc["control"]["port"] == 7400 and doc["admin_token"] == "<redacted>"


def test_bad_config_exits_4(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[control]\nport = 'x'\n")
    r = CliRunner().invoke(cli, ["config", "show", "--json", "--config", str(bad)])
    assert r.exit_code == 4 and json.loads(r.output)["ok"] is False


def test_a_guessable_token_file_is_a_usage_error(tmp_path: Path) -> None:
    """`tenants add --token-file` with a 1-character token: refused before any agent is asked
    (the agent refuses it too: tests/test_control_codec.py)."""
    token = tmp_path / "t.token"
    token.write_text("x\n")
    token.chmod(0o600)
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path / "nothing-runs-here")}
    for cmd in ("add", "rotate"):
        r = CliRunner().invoke(cli, ["tenants", cmd, "acme", "--token-file", str(token)], env=env)
        assert r.exit_code == 2 and "at least 16" in r.output, r.output


def test_usage_error_exits_2() -> None:
    assert CliRunner().invoke(cli, ["evict", "--json", "not-a-number"]).exit_code == 2


def test_unreachable_agent_exits_3(tmp_path: Path) -> None:
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path), "DPUKV_CONTROL_PORT": "1",
           "DPUKV_CONTROL_UNIX_SOCKET": ""}  # fmt: skip
    r = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert r.exit_code == 3, r.output
    assert "unreachable" in json.loads(r.output)["error"] or "connect" in r.output


def test_doctor_json_reports_every_probe() -> None:
    r = CliRunner().invoke(cli, ["doctor", "--json"])
    assert r.exit_code in (0, 1), r.output
    rows = json.loads(r.output)
    checks = {row["check"]: row for row in rows}
    for name in ("rdma", "hugepages", "spdk", "aes", "gpu", "gpudirect", "bluefield-crypto",
                 "mlxconfig", "nvme-tcp", "serf", "redis-server"):  # fmt: skip
        assert checks[name]["status"] in ("ok", "fallback", "missing"), checks[name]
    assert r.exit_code == (1 if any(x["status"] == "missing" for x in rows) else 0)


def _ok(agent: AgentProcess, r: subprocess.CompletedProcess[str], code: int = 0) -> None:
    """`r` exited with `code`; else its whole output and the agent's log tail (a CI failure
    that printed only a truncated repr could not be diagnosed)."""
    if r.returncode != code:
        log = (agent.data_dir / "agent.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"dpuctl {r.args[3:]} exited {r.returncode} (wanted {code}); agent "
                    f"exit {agent.proc.poll()}\nstdout: {r.stdout}\nstderr: {r.stderr}\n"
                    f"agent.log tail:\n{log}")  # fmt: skip


def test_status_stats_tenants_checkpoint_backup(agent: AgentProcess, tmp_path: Path) -> None:
    d = agent.data_dir
    r = dpuctl(d, "status", "--json")
    _ok(agent, r)
    assert json.loads(r.stdout)["members"][0]["control"] == agent.control_url
    r = dpuctl(d, "stats", "--json")
    _ok(agent, r)
    assert "default" in json.loads(r.stdout)["stats"]["tenants"]
    r = dpuctl(d, "tenants", "add", "acme", "--json")
    _ok(agent, r)
    assert json.loads(r.stdout)["token"] == (d / "tenant-acme.token").read_text().strip()
    _ok(agent, dpuctl(d, "tenants", "add", "acme", "--json"), 1)  # exists
    r = dpuctl(d, "tenants", "list", "--json")
    _ok(agent, r)
    assert [t["name"] for t in json.loads(r.stdout)["tenants"]] == ["acme", "default"]
    _ok(agent, dpuctl(d, "evict", "--tenant", "acme", "4096", "--json"))
    _ok(agent, dpuctl(d, "evict", "--tenant", "nobody", "4096", "--json"), 1)
    _ok(agent, dpuctl(d, "tenants", "remove", "acme", "--yes", "--json"))
    _ok(agent, dpuctl(d, "checkpoint", "--json"))
    r = dpuctl(d, "backup", "create", str(tmp_path / "b1"), "--json")
    _ok(agent, r)
    assert (tmp_path / "b1" / "manifest.json").exists()
    r = dpuctl(d, "status")  # the human table, piped: not cut to 80 columns
    _ok(agent, r)
    assert f"dpukv agent {agent.state['node']}" in r.stdout
    assert "…" not in r.stdout and agent.control_url.removeprefix("tcp://") in r.stdout
    assert agent.proc.poll() is None  # every command above left the agent serving


def test_stale_state_file_of_a_killed_agent_is_ignored(tmp_path: Path) -> None:
    _admin_token(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "agent.json").write_text(json.dumps(
        {"pid": gone.pid, "control": {"tcp": "tcp://127.0.0.1:9", "unix": ""}}))  # fmt: skip
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path), "DPUKV_CONTROL_PORT": "1",
           "DPUKV_CONTROL_UNIX_SOCKET": ""}  # fmt: skip
    r = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert r.exit_code == 3 and "127.0.0.1:1" in json.loads(r.output)["error"], r.output


@pytest.mark.parametrize(
    "state",
    [
        {"pid": 1e30, "control": {"tcp": "tcp://127.0.0.1:9", "unix": ""}},
        {"pid": -1, "control": {"tcp": "tcp://127.0.0.1:9", "unix": ""}},
        {"pid": "self", "control": {"tcp": "garbage", "unix": ""}},
        {"pid": "self", "control": {"tcp": "tcp://127.0.0.1:99999", "unix": ""}},
        {"pid": "self", "control": {"tcp": "tcp://[::1", "unix": ""}},
        {"pid": "self", "control": {"tcp": "", "unix": 5}},
    ],
    ids=["pid-1e30", "pid--1", "url-garbage", "url-port", "url-bracket", "url-int"],
)
def test_a_damaged_state_file_is_no_traceback(tmp_path: Path, state: dict) -> None:
    """A huge pid raised OverflowError, a damaged URL ValueError, in every admin command:
    the configuration's address is used instead, and an unreachable agent exits 3."""
    _admin_token(tmp_path)
    if state["pid"] == "self":
        state = {**state, "pid": os.getpid()}  # alive: the URL is what is damaged
    (tmp_path / "agent.json").write_text(json.dumps(state))
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path), "DPUKV_CONTROL_PORT": "1",
           "DPUKV_CONTROL_UNIX_SOCKET": ""}  # fmt: skip
    r = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert r.exit_code == 3 and "127.0.0.1:1" in json.loads(r.output)["error"], r.output


@pytest.mark.timeout(60)  # before: each waited ADMIN_TIMEOUT_S (an hour)
def test_a_port_that_never_answers_exits_3_within_the_hello_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack pass: another program on the control port (one that accepts and says nothing)
    held `dpuctl status` for the admin timeout, an hour."""
    monkeypatch.setattr(ops, "HELLO_TIMEOUT_S", 1.0)
    _admin_token(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path), "DPUKV_CONTROL_UNIX_SOCKET": "",
               "DPUKV_CONTROL_PORT": str(silent.getsockname()[1])}  # fmt: skip
        start = time.monotonic()
        r = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert r.exit_code == 3, r.output
    assert "no reply" in json.loads(r.output)["error"] and time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_a_stopped_agent_exits_3_within_the_hello_timeout(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack pass: an agent stopped (SIGSTOP: a hung host) held every dpuctl command for
    the admin timeout, an hour; it says so within the hello's now, and works once resumed."""
    monkeypatch.setattr(ops, "HELLO_TIMEOUT_S", 1.0)
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        r = CliRunner().invoke(cli, ["stats", "--json"], env=env)
        took = time.monotonic() - start
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    assert r.exit_code == 3 and "no reply" in json.loads(r.output)["error"], r.output
    assert took < 10
    r = CliRunner().invoke(cli, ["stats", "--json"], env=env)
    assert r.exit_code == 0 and "default" in json.loads(r.output)["stats"]["tenants"], r.output


@pytest.mark.timeout(60)
def test_a_reply_of_another_shape_is_no_traceback(tmp_path: Path) -> None:
    """A peer that speaks the protocol but answers `{}` (a broken or foreign agent): `stats`
    raised KeyError: 'stats'."""
    import struct
    import threading

    import msgpack

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)

    def serve() -> None:
        with contextlib.suppress(OSError):
            c, _ = srv.accept()
            with c:
                buf = b""
                while d := c.recv(65536):
                    buf += d
                    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                        n = struct.unpack(">I", buf[:4])[0]
                        msg, buf = msgpack.unpackb(buf[4 : 4 + n], raw=False), buf[4 + n :]
                        res = {"node": "fake"} if msg.get("op") == "hello" else {}
                        out = msgpack.packb({"id": msg["id"], "ok": True, "result": res})
                        c.sendall(struct.pack(">I", len(out)) + out)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    _admin_token(tmp_path)
    env = {"DPUKV_AGENT_DATA_DIR": str(tmp_path), "DPUKV_CONTROL_UNIX_SOCKET": "",
           "DPUKV_CONTROL_PORT": str(srv.getsockname()[1])}  # fmt: skip
    r = CliRunner().invoke(cli, ["stats", "--json"], env=env)
    srv.close()
    assert r.exit_code == 1 and "shape" in json.loads(r.output)["error"], r.output
