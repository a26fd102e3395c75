"""`dpuctl bench nvme`: NVMe/TCP throughput of our target + initiator vs a plain socket pair.

Topology (the same for every row, so ratios compare like with like): the target runs in a
separate process (`python -m dpu_agent.nvmf`) on 127.0.0.1 over a MemoryBlockDevice (wrapped
in a CryptoBlockDevice for the encrypted rows); the initiator (`host_shim.nvme`) runs in this
process with one I/O queue of depth QD. Each call moves 16 MiB sequentially in commands of
`io_kib`, QD of them in flight (fio's iodepth). The ceiling is a plain Python socket pair
across the same two-process boundary moving the same bytes through buffers of the same size
(blocking `sendall`/`recv_into` of 1 MiB messages walking a 16 MiB buffer on our side, the
size of the initiator's, and a 64 MiB one on the far side, the size of the namespace: a
1 MiB buffer that stays in cache would flatter the ceiling by about a third here). It is
measured in the same direction in slices alternated with the row's own (5 of each), because
this machine's load drifts within seconds; `ratio` is the median over the slices of NVMe /
ceiling, so one slice that another job stalled does not decide it.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import click

from dpu_agent.bench.nvme_security import print_rows, security_rows
from dpu_agent.nvmf import TargetProcess
from host_shim.nvme import NvmeTcpController

__all__ = ["NvmeBenchRow", "nvme", "run_bench"]

NQN = "nqn.2026-11.io.dpu-kvtier:bench"
HOSTNQN = "nqn.2026-11.io.dpu-kvtier:bench-host"
NS_BLOCKS = 16384  # 64 MiB namespace: sequential I/O wraps around it
MESSAGE_BYTES = 1 << 20
SPAN_BYTES = 16 << 20  # bytes per call: 16 commands of 1 MiB or 128 of 128 KiB
ROUNDS = 5  # ceiling and NVMe slices alternated per row (odd: the median is one of them)
SECONDS_PER_ROW_MAX = 30.0  # a row never runs longer than this, whatever --seconds says


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmeBenchRow:
    op: str
    io_kib: int
    qd: int
    encrypted: bool
    gbps: float
    ratio: float


def _ceiling_server() -> None:
    """Subprocess side of the socket ceiling: per connection, b"s" streams 1 MiB messages to
    the client, b"r" drains what the client sends, b"q" exits."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    region = memoryview(bytearray(NS_BLOCKS * 4096))  # as big as the target's namespace
    while True:
        conn, _ = srv.accept()
        with conn:
            mode = conn.recv(1)
            if mode in (b"q", b""):
                return
            try:
                if mode == b"s":
                    for off in itertools.cycle(range(0, len(region), MESSAGE_BYTES)):
                        conn.sendall(region[off : off + MESSAGE_BYTES])
                for off in itertools.cycle(range(0, len(region), MESSAGE_BYTES)):
                    if not conn.recv_into(region[off : off + MESSAGE_BYTES]):
                        break
            except OSError:
                pass


class _CeilingPeer:
    """A plain socket peer in another process, measured next to each row."""

    def __init__(self) -> None:
        code = "from dpu_agent.bench.nvme import _ceiling_server; _ceiling_server()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.span = memoryview(bytearray(SPAN_BYTES))  # as big as the initiator's buffer

    def moved(self, direction: str, seconds: float) -> tuple[int, float]:
        """(bytes, seconds) moved; 'read': the peer sends, we recv_into; 'write': we sendall,
        the peer drains."""
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(b"s" if direction == "read" else b"r")
            moved, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                view = self.span[moved % SPAN_BYTES :][:MESSAGE_BYTES]
                if direction == "read":
                    got = 0
                    while got < MESSAGE_BYTES:
                        n = sock.recv_into(view[got:])
                        if not n:
                            raise RuntimeError("ceiling peer closed early")
                        got += n
                else:
                    sock.sendall(view)
                moved += MESSAGE_BYTES
            return moved, time.perf_counter() - start

    def close(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port)) as sock:
                sock.sendall(b"q")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _measure(ctrl: NvmeTcpController, op: str, buf: bytearray, seconds: float) -> tuple[int, float]:
    """(bytes, seconds) of sequential I/O as fio does it with iodepth=qd: each call moves
    `buf` in commands of the controller's max_transfer_bytes, the queue keeping its depth of
    them in flight (no drain between commands)."""
    blocks = len(buf) // 4096
    lba, moved, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if lba + blocks > NS_BLOCKS:
            lba = 0
        if op == "read":
            ctrl.read(1, lba, buf)
        else:
            ctrl.write(1, lba, buf)
        lba += blocks
        moved += len(buf)
    return moved, time.perf_counter() - start


def run_bench(
    *,
    seconds: float = 1.0,
    sizes_kib: tuple[int, ...] = (128, 1024),
    qds: tuple[int, ...] = (1, 8),
    encrypted: tuple[bool, ...] = (False, True),
) -> dict[str, Any]:
    """Each row is measured right after the socket ceiling in the same direction (this
    machine's load drifts within seconds); its ratio is against that ceiling."""
    seconds = min(seconds, SECONDS_PER_ROW_MAX)
    peer = _CeilingPeer()
    rows: list[dict[str, Any]] = []
    try:
        for enc in encrypted:
            key = os.urandom(64) if enc else None
            with TargetProcess(NQN, allow_hosts=[HOSTNQN], blocks=NS_BLOCKS, xts_key=key) as t:
                for io_kib in sizes_kib:
                    for qd in qds:
                        rows += _rows(peer, t.port, io_kib, qd, enc, seconds)
    finally:
        peer.close()
    return {
        "socket_ceiling_gbps": round(statistics.median(r["ceiling_gbps"] for r in rows), 3),
        "target": "subprocess (python -m dpu_agent.nvmf) on 127.0.0.1, MemoryBlockDevice "
        "(CryptoBlockDevice over it when encrypted), MDTS 1 MiB",
        "initiator": "host_shim.nvme in this process, 1 I/O queue of depth qd",
        "seconds_per_row": seconds,
        "results": rows,
    }


def _rows(
    peer: _CeilingPeer, port: int, io_kib: int, qd: int, enc: bool, seconds: float
) -> list[dict[str, Any]]:
    ctrl = NvmeTcpController.connect(
        "127.0.0.1",
        port,
        NQN,
        HOSTNQN,
        io_queues=1,
        queue_depth=max(2, qd),
        max_transfer_bytes=io_kib << 10,
    )
    out = []
    buf = bytearray(max(SPAN_BYTES, (io_kib << 10) * qd))
    try:
        for op in ("write", "read"):
            # Interleaved slices of ceiling and NVMe: load that drifts hits both alike, and the
            # median of the slices' ratios ignores a slice that another job stalled.
            ceilings, nvmes = [], []
            for _ in range(ROUNDS):
                ceilings.append(peer.moved(op, seconds / ROUNDS))
                nvmes.append(_measure(ctrl, op, buf, seconds / ROUNDS))
            ratio = statistics.median(
                (b / t) / (cb / ct) for (b, t), (cb, ct) in zip(nvmes, ceilings, strict=True)
            )
            ceiling = sum(b for b, _ in ceilings) / sum(t for _, t in ceilings) / 1e9
            gbps = sum(b for b, _ in nvmes) / sum(t for _, t in nvmes) / 1e9
            row = NvmeBenchRow(
                op=op,
                io_kib=io_kib,
                qd=qd,
                encrypted=enc,
                gbps=round(gbps, 3),
                ratio=round(ratio, 3),
            )
            out.append({**asdict(row), "ceiling_gbps": round(ceiling, 3)})
    finally:
        ctrl.close()
    return out


@click.command("nvme", help="NVMe/TCP read/write GB/s (target in a subprocess) vs a socket pair.")
@click.option("--json", "as_json", is_flag=True, help="print the JSON report")
@click.option("--seconds", default=1.0, show_default=True, help="seconds per row (max 30)")
@click.option("--no-encrypted", is_flag=True, help="skip the CryptoBlockDevice rows")
@click.option("--security", is_flag=True, help="add the auth/tls rows (1 MiB QD8, vs plain)")
def nvme(as_json: bool, seconds: float, no_encrypted: bool, security: bool) -> None:
    report = run_bench(seconds=seconds, encrypted=(False,) if no_encrypted else (False, True))
    if security:  # DH-HMAC-CHAP / TLS cost (dpu_agent/bench/nvme_security.py)
        report["security"] = security_rows(seconds)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"socket ceiling {report['socket_ceiling_gbps']:.2f} GB/s")
    for r in report["results"]:
        click.echo(
            f"{r['op']:5} {r['io_kib']:5} KiB QD{r['qd']:<2} "
            f"{'enc' if r['encrypted'] else 'plain':5} {r['gbps']:6.2f} GB/s  {r['ratio']:.2f}"
        )
    if security:
        print_rows(report["security"], click.echo)
