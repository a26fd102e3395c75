"""A `serf agent` child process: the agent's own Serf, or the ones tests and benchmarks start.

Ports are explicit (Serf has no port 0); `free_port()` picks one. The child dies with us:
`stop()` asks it to leave (SIGINT: Serf's graceful leave), `kill()` is kill -9 (a crash), and
the kernel stops it when its parent dies (`_dies_with_parent`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpu_agent.cluster._serf_client import SerfClient, SerfUnreachable
from dpu_agent.config import check_secret_mode

__all__ = ["SERF_START_TIMEOUT_S", "SerfProcess", "free_port", "name_conflict_in"]

SERF_START_TIMEOUT_S = 20.0  # Serf starts in ~0.1 s; a loaded 2-core box is far slower
SERF_STOP_TIMEOUT_S = 10.0  # a graceful leave waits for its broadcast (5 s by default)


# Serf has no port 0: ports are picked for it, below Linux's ephemeral range (32768-60999) so
# that a port 0 bind elsewhere (our own NVMe/TCP target, other tests) cannot take it between
# the pick and Serf's bind.
PICK_PORT_RANGE = (20000, 32000)
PICK_PORT_TRIES_MAX = 256
# Ports handed out and not handed out again: a pick is free when made, but nothing holds it
# until Serf binds, so two picks in a row (a node's gossip and RPC ports) could return the
# same port, and that Serf would exit 1 (a CI rehearsal saw `serf agent a1 exited with 1`
# once, its output not kept: this is the cause that fits, not a proven one)
PICKED_REMEMBERED = 2048
_picked: deque[int] = deque(maxlen=PICKED_REMEMBERED)
_picked_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now for TCP and UDP (Serf binds both on its gossip port), and none of
    the last PICKED_REMEMBERED this process was given."""
    rng = random.Random()
    for _ in range(PICK_PORT_TRIES_MAX):
        port = rng.randrange(*PICK_PORT_RANGE)
        with _picked_lock:  # remembered even if busy below: a busy port is no loss
            if port in _picked:
                continue
            _picked.append(port)
        with socket.socket() as s, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            try:
                s.bind((host, port))
                u.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free TCP+UDP port in {PICK_PORT_RANGE} on {host}")


def _dies_with_parent() -> list[str]:
    """`setpriv --pdeathsig TERM` (util-linux): the kernel sends Serf SIGTERM when its parent
    dies, kill -9 included, so a crashed agent leaves no Serf behind holding its ports and
    gossiping a member nobody serves (without it, every kill -9 test left two `serf agent`
    processes running). The signal comes when the thread that spawned Serf exits; the agent
    spawns it from a thread of its loop's executor, which lives as long as the agent. SIGTERM
    makes Serf exit without a graceful leave, so the others see a failure, as for kill -9.
    Without setpriv (not Linux, no util-linux) Serf runs as before and can outlive a crash."""
    path = shutil.which("setpriv")
    return [path, "--pdeathsig", "TERM"] if path else []


SERF_LOG_TAIL_BYTES = 64 << 10  # what name_conflict_in reads of Serf's log
# Serf's words when it quits for losing a node-name vote (serf/serf.go, resolveNodeConflict),
# and the line before naming the other node ("Node name conflicts with another node at ...")
_QUIT_FOR_CONFLICT = "minority in name conflict resolution"
_CONFLICT_AT = re.compile(r"conflicts with another node at (\S+?)\.? Names must be unique")


def name_conflict_in(log_path: str | os.PathLike[str] | None) -> str | None:
    """The other node's address when Serf's log ends with it quitting over our node name
    (another member has it), else None."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - SERF_LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    quit_at = tail.rfind(_QUIT_FOR_CONFLICT)
    if quit_at < 0:
        return None
    found = _CONFLICT_AT.findall(tail[:quit_at])
    return found[-1] if found else "?"


class SerfProcess:
    """`serf agent -node NAME -bind HOST:PORT -rpc-addr HOST:PORT [-tag k=v ...] [-join ...]`."""

    def __init__(
        self,
        node: str,
        *,
        bind: str,
        rpc_addr: str,
        tags: Mapping[str, str] | None = None,
        join: Sequence[str] = (),
        auth_key: str = "",
        profile: str = "lan",
        serf_bin: str = "serf",
        log_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        netns: str = "",
        keyring_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`keyring_file`: Serf's gossip keyring (JSON list of base64 keys, mode 0600; Serf
        rewrites it when keys change); without it gossip is plaintext (tests of Serf only)."""
        path = shutil.which(serf_bin)
        if path is None:
            raise FileNotFoundError(f"{serf_bin} not found; apt-get install serf")
        self.node, self.bind, self.rpc_addr, self.auth_key = node, bind, rpc_addr, auth_key
        args = [path, "agent", f"-node={node}", f"-bind={bind}", f"-rpc-addr={rpc_addr}",
                f"-profile={profile}", "-log-level=warn", *extra_args]  # fmt: skip
        if netns:  # a network namespace the caller made (tests: a partitionable node)
            args = ["ip", "netns", "exec", netns, *args]
        args = [*_dies_with_parent(), *args]
        for k, v in (tags or {}).items():
            args += ["-tag", f"{k}={v}"]
        for seed in join:
            args.append(f"-retry-join={seed}")  # not -join: a dead seed must not stop us
        if join:
            args.append("-retry-interval=1s")
        if keyring_file is not None:
            check_secret_mode(Path(keyring_file))  # ConfigError when others may read it
            args.append(f"-keyring-file={Path(keyring_file).absolute()}")
        self._config_dir: tempfile.TemporaryDirectory[str] | None = None
        if auth_key:  # rpc_auth exists only in the JSON config; a 0600 file, never argv
            self._config_dir = tempfile.TemporaryDirectory(prefix="serf-cfg-")
            cfg = Path(self._config_dir.name) / "rpc.json"
            fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"rpc_auth": auth_key}, f)
            args.append(f"-config-file={cfg}")
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)  # fmt: skip
        finally:
            if log_path:
                out.close()  # type: ignore[union-attr]

    def wait_ready(self, timeout_s: float = SERF_START_TIMEOUT_S) -> SerfClient:
        """A connected RPC client once the agent answers; RuntimeError if it exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serf agent {self.node} exited with {self.proc.returncode}")
            try:
                return SerfClient(self.rpc_addr, auth_key=self.auth_key, timeout_s=5.0)
            except SerfUnreachable:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"serf agent {self.node} did not open {self.rpc_addr} in {timeout_s} s"
                    ) from None
                time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = SERF_STOP_TIMEOUT_S) -> None:
        """Graceful: SIGINT makes Serf leave the cluster, then exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def kill(self) -> None:
        """kill -9: the others see it fail."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._cleanup()

    def pause(self) -> None:
        """SIGSTOP: a partitioned node (it answers nobody) until resume()."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def _cleanup(self) -> None:
        if self._config_dir is not None:
            with contextlib.suppress(OSError):
                self._config_dir.cleanup()
            self._config_dir = None
