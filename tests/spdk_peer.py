"""Test support: run the SPDK v26.05 peer (bdevperf, spdk_nvme_perf/identify/discover, spdk_tgt).

The peer is found through SPDK_BIN only (README, "The SPDK peer in the tests", says how to
install it; `.ci/run` does it where the workspace provides it); nothing else is read.
Without it every live test skips with `SKIP_REASON`. Every run is bounded in time
(`RUN_TIMEOUT_S`) and uses one core (`-m 0x1`): SPDK's reactor busy-polls it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SPDK_BIN = os.environ.get("SPDK_BIN", "")
SKIP_REASON = (
    "SPDK_BIN is not set: the SPDK v26.05 peer is not installed "
    '(README: "The SPDK peer in the tests")'
)
needs_spdk = pytest.mark.skipif(
    not (SPDK_BIN and Path(SPDK_BIN, "bdevperf").exists()), reason=SKIP_REASON
)
RUN_TIMEOUT_S = 120.0  # one tool run: start (~1 s) + -t seconds + teardown, on a loaded box
START_TIMEOUT_S = 30.0  # spdk_tgt/bdevperf creating its RPC socket
MEM_MB = "1024"  # DPDK memory without hugepages: bdevperf verify at 1 MiB x QD64 needs ~600
SPDK_COMMON = ["--no-huge", "-s", MEM_MB, "--disable-cpumask-locks", "-m", "0x1"]
# What must never appear in a clean run's logs (target or peer).
PROTOCOL_ERRORS = re.compile(
    r"nvmf_protocol_error|nvmf_h2c_term_req|C2HTermReq|Buffer mismatch|miscompare"
    r"|nvme_tcp_c2h_term_req|Transport error|transport error|in failed state",
    re.IGNORECASE,
)

# spdk_nvme_perf frees its I/O queues before the last poll and logs this for each, against
# SPDK's own target too (checked here): teardown noise, not an error of the target.
PERF_TEARDOWN = re.compile(r"DISCONNECTED\] CQ transport error -6 \(No such device or address\)")


def protocol_errors(text: str) -> list[str]:
    """Lines of a log that show a protocol or data error (known teardown noise excluded)."""
    return [
        line
        for line in text.splitlines()
        if PROTOCOL_ERRORS.search(line) and not PERF_TEARDOWN.search(line)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tool(name: str) -> str:
    return str(Path(SPDK_BIN, name))


def trid(port: int, nqn: str, hostnqn: str | None = None) -> str:
    s = f"trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn}"
    return s + (f" hostnqn:{hostnqn}" if hostnqn else "")


def attach_params(
    name: str, port: int, nqn: str, hostnqn: str, *, hdgst: bool = False, ddgst: bool = False
) -> dict[str, Any]:
    return {
        "name": name,
        "trtype": "tcp",
        "adrfam": "ipv4",
        "traddr": "127.0.0.1",
        "trsvcid": str(port),
        "subnqn": nqn,
        "hostnqn": hostnqn,
        "hdgst": hdgst,
        "ddgst": ddgst,
    }


@dataclass
class BdevperfResult:
    rc: int
    out: str
    iops: float
    fail_per_s: float
    mib_s: float

    @property
    def clean(self) -> bool:
        return (
            self.rc == 0
            and self.iops > 0
            and self.fail_per_s == 0
            and not protocol_errors(self.out)
        )


_TOTAL = re.compile(r"^\s*Total\s*:\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.MULTILINE)


def bdevperf(
    tmp: Path,
    port: int,
    nqn: str,
    hostnqn: str,
    *,
    io_bytes: int,
    qd: int,
    seconds: int,
    workload: str = "verify",
    hdgst: bool = False,
    ddgst: bool = False,
    jobs: int = 1,
    ns_blocks: int = 0,
) -> BdevperfResult:
    """bdevperf -w verify (by default) against one controller attached over NVMe/TCP.

    `jobs` > 1: that many jobs on the one namespace, each over its own slice of `ns_blocks`
    (a job config file; offset and length count blocks). Each job runs on its own SPDK thread,
    and bdev_nvme gives each thread its own qpair: `jobs` I/O queues on one controller."""
    cfg = tmp / f"bdevperf-{port}-{io_bytes}-{qd}.json"
    attach = attach_params("N0", port, nqn, hostnqn, hdgst=hdgst, ddgst=ddgst)
    cfg.write_text(
        json.dumps(
            {
                "subsystems": [
                    {
                        "subsystem": "bdev",
                        "config": [{"method": "bdev_nvme_attach_controller", "params": attach}],
                    }
                ]
            }
        )
    )
    args = [
        tool("bdevperf"),
        *SPDK_COMMON,
        "--no-pci",
        "-r",
        str(tmp / f"bdevperf-{port}.sock"),
        "--json",
        str(cfg),
        "-t",
        str(seconds),
    ]
    if jobs > 1:
        per = ns_blocks // jobs
        job = tmp / f"bdevperf-{port}-{io_bytes}-{qd}.ini"
        job.write_text(
            f"[global]\nfilename=N0n1\nrw={workload}\nbs={io_bytes}\niodepth={qd}\n"
            + "".join(f"[job{i}]\noffset={i * per}\nlength={per}\n" for i in range(jobs))
        )
        args += ["-j", str(job)]
    else:
        args += ["-q", str(qd), "-o", str(io_bytes), "-w", workload]
    r = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out = r.stdout + r.stderr
    m = _TOTAL.search(r.stdout)
    iops, mib_s, fail = (float(m[1]), float(m[2]), float(m[3])) if m else (0.0, 0.0, -1.0)
    return BdevperfResult(rc=r.returncode, out=out, iops=iops, mib_s=mib_s, fail_per_s=fail)


def nvme_perf(
    port: int,
    nqn: str,
    hostnqn: str,
    *,
    io_bytes: int,
    qd: int,
    seconds: int,
    queues: int = 1,
    workload: str = "randrw",
    hdgst: bool = False,
    ddgst: bool = False,
) -> subprocess.CompletedProcess[str]:
    args = [
        tool("spdk_nvme_perf"),
        "--no-huge",
        "-s",
        MEM_MB,
        "-c",
        "0x1",
        "-q",
        str(qd),
        "-o",
        str(io_bytes),
        "-w",
        workload,
        "-M",
        "50",
        "-t",
        str(seconds),
        "-P",
        str(queues),
        "-r",
        trid(port, nqn, hostnqn),
    ]
    args += ["-H"] if hdgst else []
    args += ["-I"] if ddgst else []
    return subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def identify(port: int, nqn: str) -> subprocess.CompletedProcess[str]:
    args = [tool("spdk_nvme_identify"), "--no-huge", "-s", "512", "-r", trid(port, nqn)]
    return subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def discover(port: int) -> subprocess.CompletedProcess[str]:
    """The discovery log through spdk_nvme_identify (its default subsystem is the discovery
    NQN). spdk_nvme_discover v26.05 takes no memory options and needs hugepages."""
    args = [tool("spdk_nvme_identify"), "--no-huge", "-s", "512", "-r", trid_discovery(port)]
    return subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def trid_discovery(port: int) -> str:
    return f"trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port}"


class SpdkApp:
    """A running SPDK application (spdk_tgt, or bdevperf -z) with its RPC socket and log."""

    def __init__(self, args: list[str], sock: Path, log: Path) -> None:
        self.sock, self.log_path = sock, log
        self._log = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start: {self.log()[-2000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rpc(self, method: str, timeout_s: float = 30.0, **params: Any) -> Any:
        """One JSON-RPC call on the app's socket (the wire protocol; no client library)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.sock))
            req: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method}
            if params:
                req["params"] = params
            s.sendall(json.dumps(req).encode())
            buf = b""
            dec = json.JSONDecoder()
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    raise RuntimeError(f"{method}: connection closed")
                buf += chunk
                try:
                    doc, _ = dec.raw_decode(buf.decode())
                    break
                except ValueError:
                    continue
        if "error" in doc:
            raise RuntimeError(f"{method}: {doc['error']}")
        return doc["result"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def bdevperf_idle(tmp: Path) -> Iterator[SpdkApp]:
    """bdevperf -z: an SPDK initiator application waiting for RPCs (attach/detach/perform)."""
    sock = tmp / f"bdevperf-idle-{free_port()}.sock"
    args = [
        tool("bdevperf"),
        *SPDK_COMMON,
        "--no-pci",
        "-r",
        str(sock),
        "-z",
        "-q",
        "8",
        "-o",
        "4096",
        "-w",
        "verify",
        "-t",
        "1",
    ]
    app = SpdkApp(args, sock, tmp / "bdevperf-idle.log")
    try:
        yield app
    finally:
        app.stop()


@contextmanager
def spdk_tgt(tmp: Path, config: dict[str, Any] | None = None) -> Iterator[SpdkApp]:
    sock = tmp / f"spdk-{free_port()}.sock"
    args = [tool("spdk_tgt"), *SPDK_COMMON, "--no-pci", "-r", str(sock)]
    if config is not None:
        path = tmp / "spdk_tgt.json"
        path.write_text(json.dumps(config))
        args += ["--json", str(path)]
    app = SpdkApp(args, sock, tmp / "spdk_tgt.log")
    try:
        yield app
    finally:
        app.stop()
