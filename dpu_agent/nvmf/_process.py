"""TargetProcess: run `python -m dpu_agent.nvmf` in a child process (tests, benchmarks).

A target in its own process has its own GIL, as a real deployment has, so measurements and
cross-process tests see what a host would see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable

__all__ = ["START_TIMEOUT_S", "XTS_KEY_ENV", "TargetProcess"]

XTS_KEY_ENV = "DPU_NVMF_XTS_KEY_HEX"  # 64-byte AES-XTS key (hex) for namespace 1

START_TIMEOUT_S = 30.0  # interpreter start plus imports on a loaded two-core machine
STOP_TIMEOUT_S = 10.0


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
            code = self.proc.wait(START_TIMEOUT_S)
            raise RuntimeError(f"target process exited with {code} before listening")
        self.port = int(json.loads(line)["port"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> int:
        """Stop the target (closing its stdin); returns its exit code."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> TargetProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
