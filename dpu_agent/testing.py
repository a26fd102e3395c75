"""Test and benchmark support: the agent and the standalone NVMe/TCP target in child processes.

The runtime never imports this module (tests/test_package_imports.py checks it); tests,
benchmarks (dpu_agent.bench) and examples do.

    agent = spawn_agent(tmp_path)          # `dpuctl agent run` on ephemeral loopback ports
    KVClient(agent.control_url, "default", agent.token, layout, salt)
    agent.stop()

    with TargetProcess("nqn.2026-11.io.example:t", allow_any_host=True) as target:
        ...  # NvmeTcpController.connect("127.0.0.1", target.port, ...)

A child has its own GIL, as a real deployment has, so measurements and cross-process tests see
what a host would see.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpu_agent.nvmf.__main__ import XTS_KEY_ENV
from host_shim.control import ControlChannel
from kvproto.control import ADMIN_TENANT

__all__ = [
    "SPAWN_TIMEOUT_S",
    "TARGET_START_TIMEOUT_S",
    "XTS_KEY_ENV",
    "AgentProcess",
    "TargetProcess",
    "spawn_agent",
]

SPAWN_TIMEOUT_S = 60.0  # first start builds tiers and the journal; on a loaded 2-core box
TARGET_START_TIMEOUT_S = 30.0  # interpreter start plus imports on a loaded two-core machine
TARGET_STOP_TIMEOUT_S = 10.0


# --- an agent in a child process ---------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` in bytes (/proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# What `dpuctl agent run` is, as the `python -c` program of a child
AGENT_PROGRAM = "from dpu_agent.cli import main; main()"


@dataclass(slots=True, kw_only=True)
class AgentProcess:
    """A `dpuctl agent run` child with its addresses (from its state file) and tokens."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    state: dict[str, Any]
    token: str = field(repr=False)
    admin_token: str = field(repr=False)

    @property
    def control_url(self) -> str:
        return str(self.state["control"]["tcp"])

    @property
    def unix_url(self) -> str:
        return str(self.state["control"]["unix"])

    @property
    def metrics_url(self) -> str:
        return str(self.state["metrics"])

    @property
    def port(self) -> int:
        """The TCP control listener's port."""
        return int(self.control_url.rsplit(":", 1)[1])

    def rss(self) -> int:
        """The agent's resident memory in bytes."""
        return rss_bytes(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def admin(self, op: str, **fields: Any) -> dict[str, Any]:
        """One admin op over the Unix socket, with the admin token."""
        with ControlChannel(self.unix_url, ADMIN_TENANT, self.admin_token) as adm:
            adm.connect()
            result: dict[str, Any] = adm.call(op, **fields)
            return result

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Signal the agent and wait; SIGKILL if it does not stop in time. Returns its code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def _read_optional(path: Path) -> str:
    """The default tenant's token; "" when a config without that tenant was used."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def spawn_agent(
    data_dir: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    config: str | os.PathLike[str] | None = None,
    timeout_s: float = SPAWN_TIMEOUT_S,
    netns: str | None = None,
    program: str = AGENT_PROGRAM,
) -> AgentProcess:
    """Start an agent on ephemeral loopback ports (unless `env` says otherwise) and wait for it;
    with `netns`, inside that network namespace (`ip netns exec`: the same process id).
    `program` is the `python -c` code the child runs (tests that patch module constants
    first pass their own, ending in AGENT_PROGRAM)."""
    data = Path(data_dir).absolute()
    data.mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        "DPUKV_AGENT_DATA_DIR": str(data),
        "DPUKV_CONTROL_PORT": "0",
        "DPUKV_NVMF_PORT": "0",
        "DPUKV_METRICS_PORT": "0",
        **(env or {}),
    }
    state_path = data / "agent.json"
    with contextlib.suppress(FileNotFoundError):
        state_path.unlink()  # a stale one from a killed agent
    args = [sys.executable, "-c", program, "agent", "run"]
    if config is not None:
        args += ["--config", str(config)]
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    with open(data / "agent.log", "ab") as out:
        proc = subprocess.Popen(args, env=child_env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (data / "agent.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"agent exited with {proc.returncode} while starting:\n{tail}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            state = json.loads(state_path.read_text())
            if state.get("pid") == proc.pid:
                return AgentProcess(
                    proc=proc, data_dir=data, state=state,
                    token=_read_optional(data / "tenant-default.token"),
                    admin_token=(data / "admin.token").read_text().strip(),
                )  # fmt: skip
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"agent did not start within {timeout_s} s; see {data / 'agent.log'}")


# --- the standalone NVMe/TCP target (`python -m dpu_agent.nvmf`) in a child process -------------


class TargetProcess:
    """A target serving subsystem `nqn` (namespace 1) on 127.0.0.1:<ephemeral `.port`>."""

    def __init__(
        self,
        nqn: str,
        *,
        allow_hosts: Iterable[str] = (),
        allow_any_host: bool = False,
        blocks: int = 16384,
        file: str | os.PathLike[str] | None = None,
        xts_key: bytes | None = None,
        max_io_size: int = 1 << 20,
        keep_alive_granularity_ms: int = 10000,
        log_level: str = "WARNING",
        host_keys_file: str | os.PathLike[str] | None = None,
        require_auth: bool = False,
        extra_args: Iterable[str] = (),
        port: int = 0,
        log_path: str | os.PathLike[str] | None = None,
        tiers_dir: str | os.PathLike[str] | None = None,
        also_nqns: Iterable[str] = (),
    ) -> None:
        """`port` 0 picks a free one; `log_path` receives the target's log (JSON lines)
        instead of this process's stderr."""
        args = [
            sys.executable,
            "-m",
            "dpu_agent.nvmf",
            "--nqn",
            nqn,
            "--blocks",
            str(blocks),
            "--max-io-size",
            str(max_io_size),
            "--log-level",
            log_level,
            "--keep-alive-granularity-ms",
            str(keep_alive_granularity_ms),
            "--port",
            str(port),
        ]
        for h in allow_hosts:
            args += ["--allow-host", h]
        for other in also_nqns:  # more subsystems (tenants), each a memory namespace 1
            args += ["--also-nqn", other]
        if allow_any_host:
            args.append("--allow-any-host")
        if file is not None:
            args += ["--file", os.fspath(file)]
        if host_keys_file is not None:  # DH-HMAC-CHAP/TLS keys (docs/NVME_AUTH.md)
            args += ["--host-keys", os.fspath(host_keys_file)]
        if require_auth:
            args.append("--require-auth")
        args += list(extra_args)
        if tiers_dir is not None:  # the agent's namespace stack: nsid 1 DRAM, nsid 2 NVMe tier
            args += ["--tiers-dir", os.fspath(tiers_dir)]
        env = dict(os.environ)
        if xts_key is not None:  # in the child's environment, not on its command line
            env[XTS_KEY_ENV] = xts_key.hex()
        self.log_path = log_path
        log = open(log_path, "ab") if log_path is not None else None
        try:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env
            )
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(TARGET_START_TIMEOUT_S)
            raise RuntimeError(f"target process exited with {code} before listening")
        self.port = int(json.loads(line)["port"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> int:
        """Stop the target (closing its stdin); returns its exit code."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(TARGET_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> TargetProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
