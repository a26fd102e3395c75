"""SPDK (the real peer: README, "The SPDK peer in the tests") for the DH-HMAC-CHAP and TLS interop
tests: keyring files, a target with keys, bdevperf with keys. The general helpers are
`spdk_peer`'s.

`SPDK_TGT` / `SPDK_BIN` come from the environment (README says how); tests skip
with that reason when they are not set.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from spdk_peer import free_port

__all__ = ["free_port"]  # re-exported for the auth tests

SPDK_TGT = os.environ.get("SPDK_TGT", "")
SPDK_BIN = os.environ.get("SPDK_BIN", "")
START_TIMEOUT_S = 60.0
SKIP_REASON = 'SPDK_TGT is not set: install the SPDK peer (README: "The SPDK peer in the tests")'


def require_spdk() -> None:
    if not SPDK_TGT or not Path(SPDK_TGT).exists():
        pytest.skip(SKIP_REASON)


def write_key(directory: Path, name: str, text: str) -> Path:
    """A key file as SPDK's keyring_file wants it: mode 0600."""
    path = directory / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def keyring_config(keys: dict[str, Path]) -> dict[str, Any]:
    return {
        "subsystem": "keyring",
        "config": [
            {"method": "keyring_file_add_key", "params": {"name": n, "path": str(p)}}
            for n, p in keys.items()
        ],
    }


def listen_address(port: int) -> dict[str, str]:
    return {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-2000:] if log.exists() else ""
                pytest.fail(f"SPDK did not listen on {port} (exit {proc.poll()}):\n{tail}")
            time.sleep(0.1)


@contextmanager
def spdk_target(workdir: Path, config: dict[str, Any], port: int) -> Iterator[Path]:
    """spdk_tgt with `config` (JSON), waiting until `port` listens; yields its log path."""
    cfg = workdir / "spdk.json"
    cfg.write_text(json.dumps(config))
    log = workdir / "spdk.log"
    args = [SPDK_TGT, "--json", str(cfg), "-r", str(workdir / "spdk.sock"), "-m", "0x1"]
    args += ["--no-huge", "-s", "1024", "--no-pci", "--disable-cpumask-locks"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_listening(port, proc, log)
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bdevperf(
    workdir: Path,
    attach: dict[str, Any],
    keys: dict[str, Path],
    *,
    seconds: int = 2,
    options: dict[str, Any] | None = None,
) -> subprocess.CompletedProcess[str]:
    """SPDK's bdevperf attached by `bdev_nvme_attach_controller(**attach)`, `-w verify`;
    `options` go to `bdev_nvme_set_options` first (dhchap_digests, dhchap_dhgroups)."""
    bdev: list[dict[str, Any]] = []
    if options:
        bdev.append({"method": "bdev_nvme_set_options", "params": options})
    bdev.append({"method": "bdev_nvme_attach_controller", "params": attach})
    cfg = {"subsystems": [keyring_config(keys), {"subsystem": "bdev", "config": bdev}]}
    path = workdir / f"bdevperf-{attach['name']}.json"
    path.write_text(json.dumps(cfg))
    exe = str(Path(SPDK_BIN) / "bdevperf")
    args = [exe, "--no-huge", "-s", "512", "--no-pci", "--disable-cpumask-locks"]
    args += ["-r", str(workdir / f"bdevperf-{attach['name']}.sock"), "--json", str(path)]
    args += ["-q", "8", "-o", "4096", "-w", "verify", "-t", str(seconds)]
    return subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)


@contextmanager
def bdevperf_waiting(
    workdir: Path,
    attach: dict[str, Any],
    keys: dict[str, Path],
    *,
    seconds: int = 1,
) -> Iterator[Any]:
    """bdevperf -z (waits for RPCs), attached; yields a JSON-RPC client on its socket."""
    from spdk.rpc.client import JSONRPCClient

    cfg = {
        "subsystems": [
            keyring_config(keys),
            {
                "subsystem": "bdev",
                "config": [{"method": "bdev_nvme_attach_controller", "params": attach}],
            },
        ]
    }
    path = workdir / f"bdevperf-z-{attach['name']}.json"
    path.write_text(json.dumps(cfg))
    sock = workdir / f"bdevperf-z-{attach['name']}.sock"
    log = workdir / f"bdevperf-z-{attach['name']}.log"
    args = [str(Path(SPDK_BIN) / "bdevperf"), "--no-huge", "-s", "512", "--no-pci"]
    args += ["--disable-cpumask-locks", "-r", str(sock), "--json", str(path), "-z"]
    args += ["-q", "8", "-o", "4096", "-w", "verify", "-t", str(seconds)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = None
        while client is None:
            try:
                client = JSONRPCClient(str(sock), timeout=60.0)
                client.call("bdev_get_bdevs")
            except Exception:
                client = None
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"bdevperf did not come up:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
