"""`dpuctl bench nvme`: what hosts get over NVMe/TCP from the agent, vs SPDK and a socket pair.

Targets, each in its own process on 127.0.0.1, read and written by the same initiator
(`host_shim.nvme`, in this process, `queues` I/O queues of depth QD) with the same sizes:
- `agent-dram`, `agent-nvme`: the agent's real namespace stack for one tenant, built by the
  factory the agent uses (`python -m dpu_agent.nvmf --tiers-dir`): nsid 1 the DRAM tier, nsid 2
  the NVMe tier (a file), both under the tenant's AES-XTS key, served by our target;
- `spdk`: SPDK's own nvmf target (`spdk_tgt`, when SPDK_BIN names the peer's binaries) serving
  a crypto vbdev (AES_XTS, software accel) over a malloc bdev, MDTS 1 MiB like ours: the
  encrypted-DRAM stack as SPDK does it. Its reactor busy-polls one of this machine's cores.
- `spdk-nvme`: the same SPDK target's nsid 2, a crypto vbdev over an `aio` bdev on a file in
  the directory of the agent's NVMe tier file (same file system, same device): the encrypted
  NVMe-tier stack as SPDK does it.
Each call moves 16 MiB sequentially in commands of `io_kib`, QD of them in flight per queue
(fio's iodepth). The ceiling is a plain Python socket pair across the same two-process
boundary moving the same bytes through buffers of the same size (blocking `sendall`/`recv_into`
of 1 MiB messages walking a 16 MiB buffer on our side and a 64 MiB one on the far side, the
size of the namespace). It is measured in the same direction in slices alternated with each
row's own (5 of each), because this machine's load drifts within seconds; `ratio` is the
median over the slices of NVMe / ceiling. `vs_spdk` is an agent row's GB/s over the SPDK
row of the same op, size, depth and queues, measured in the same run (agent-dram against
`spdk`, agent-nvme against `spdk-nvme`: the same kind of store).

The NVMe-tier rows (agent-nvme, spdk-nvme) also get a device ceiling, measured in slices
alternated with theirs: the tier file system's own bandwidth at the same I/O size and depth
(`qd` threads each keeping one `pwritev`/`preadv` of `io_kib` in flight on a file next to the
tier file), doing the same kind of I/O as the row it bounds (`device_io`): buffered for
agent-nvme (the agent's tier file keeps the page cache, so its reads come from memory, and so
do the ceiling's), O_DIRECT for spdk-nvme (SPDK's aio bdev opens its file O_DIRECT where the
file system allows it, and buffered where not, as the ceiling does):
`device_ceiling_gbps`, and `vs_device` the median of the slices' row / device.

Those rows also get a socket+device reference, in slices of their own: the socket ceiling and
the device ceiling run at the same time in this process, the device moving only what the
socket has moved (rate-matched), and the lower of the two rates: roughly what moving bytes
between the socket and the file costs on this machine, where a virtual disk's I/O costs CPU
on the cores the network needs: `socket_device_gbps` (median of the slices), and
`vs_socket_device` the median of the slices' row / socket+device. It is a reference, not a
ceiling: its two threads share one interpreter and poll each other, and on a loaded box a
target in its own process moves more (rows measured 1.1-2.4x it).

Every ceiling bounds its row: SPDK's reactor busy-polls a core, so spdk_tgt is stopped
(SIGSTOP) while the ceilings of its rows run and continued for the row's own slices. A row
above one of its ceilings on one measure only (its GB/s over all slices, or the median of the
slices' ratios) carries `ceiling_exceeded_reason` (the load moved between slices); above on
both, the bench fails naming it. `vs_spdk` pairs rows on the same kind of store only:
agent-nvme (page cache) with spdk-nvme where that reads memory too (tier files on tmpfs,
`--dir /dev/shm`); on a disk that takes O_DIRECT the row says why it has no `vs_spdk`
(`vs_spdk_note`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from dpu_agent.bench.nvme_security import print_rows, security_rows
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeError, NvmeTcpController

__all__ = ["NvmeBenchRow", "nvme", "run_bench"]

NQN = "nqn.2026-11.io.dpu-kvtier:bench"
HOSTNQN = "nqn.2026-11.io.dpu-kvtier:bench-host"
NS_BLOCKS = 16384  # 64 MiB namespace: sequential I/O wraps around it
MESSAGE_BYTES = 1 << 20
SPAN_BYTES = 16 << 20  # bytes per call: 16 commands of 1 MiB or 128 of 128 KiB
ROUNDS = 5  # ceiling and NVMe slices alternated per row (odd: the median is one of them)
SECONDS_PER_ROW_MAX = 30.0  # a row never runs longer than this, whatever --seconds says
QUEUES_MAX = 8  # I/O queues of the initiator (each a connection and a thread)
SPDK_START_TIMEOUT_S = 30.0  # spdk_tgt listens within about a second; loaded boxes get 30
AGENT_TARGETS = {"agent-dram": 1, "agent-nvme": 2}  # target name -> nsid
SPDK_TARGETS = {"spdk": 1, "spdk-nvme": 2}  # target name -> nsid of the SPDK target
TARGETS = ("agent-dram", "agent-nvme", "spdk", "spdk-nvme")
DEVICE_ROWS = frozenset({"agent-nvme", "spdk-nvme"})  # rows measured next to the device ceiling
# The kind of file I/O each NVMe-tier row does, which its device ceiling does too: the agent's
# FileBlockDevice keeps the page cache; SPDK's aio bdev opens its file O_DIRECT.
ROW_DIRECT = {"agent-nvme": False, "spdk-nvme": True}
BUFFERED, DIRECT, MEMORY = "buffered (page cache)", "O_DIRECT", "memory (tmpfs)"
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


def _fs_type(path: Path) -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    best, fs = "", ""
    target = str(path.resolve())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-") + 1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fs = mount, fstype
    return fs


SAME_STORE_SPDK = {"agent-dram": "spdk", "agent-nvme": "spdk-nvme"}  # vs_spdk pairs


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmeBenchRow:
    target: str
    op: str
    io_kib: int
    qd: int
    queues: int
    encrypted: bool
    gbps: float
    ratio: float  # over the socket ceiling measured alongside


def _ceiling_server() -> None:
    """Subprocess side of the socket ceiling: per connection, b"s" streams to the client, b"r"
    drains what the client sends, b"q" exits. The socket at its best: it polls a non-blocking
    socket with one hot 1 MiB buffer, as SPDK's poll-mode target does; a blocking drain into the
    namespace-sized region woke up for every segment and SPDK's writes scored 1.1-1.2x it."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    hot = memoryview(bytearray(MESSAGE_BYTES))
    while True:
        conn, _ = srv.accept()
        with conn:
            mode = conn.recv(1)
            if mode in (b"q", b""):
                return
            try:
                conn.setblocking(False)
                if mode == b"s":
                    while True:
                        try:
                            conn.send(hot)
                        except BlockingIOError:
                            pass
                while True:
                    try:
                        if not conn.recv_into(hot):
                            break
                    except BlockingIOError:
                        pass
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

    def moved(
        self, direction: str, seconds: float, progress: list[int] | None = None
    ) -> tuple[int, float]:
        """(bytes, seconds) moved; 'read': the peer sends, we recv_into; 'write': we sendall,
        the peer drains. `progress[0]`: the bytes moved so far, kept up to date."""
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(b"s" if direction == "read" else b"r")
            moved, start = 0, time.perf_counter()
            # at least one message: a slice that a loaded box gave no time still measures a rate
            while not moved or time.perf_counter() - start < seconds:
                if progress is not None:
                    progress[0] = moved
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


class _DeviceCeiling:
    """The tier file system's own bandwidth: `qd` threads, each keeping one `io_kib` I/O in
    flight (`pwritev`/`preadv`, which release the GIL) on a file of the namespace's size,
    walking it sequentially as the NVMe rows do. `direct`: O_DIRECT, as SPDK's aio bdev, where
    the file system allows it (else buffered, as SPDK falls back to); not `direct`: through
    the page cache, as the agent's tier file."""

    def __init__(self, path: Path, *, direct: bool = True) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self.direct = False
        if direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as e:  # a file system without O_DIRECT
                if e.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o600)
        # On a file system in memory, O_DIRECT or not, the bytes come from memory alike
        memory = _fs_type(path.parent) in MEMORY_FILE_SYSTEMS
        self.kind = MEMORY if memory else DIRECT if self.direct else BUFFERED
        os.ftruncate(self.fd, NS_BLOCKS * 4096)
        # Written once in full, so that reads move bytes and not holes of a sparse file.
        self._run("write", MESSAGE_BYTES, 1, float("inf"), NS_BLOCKS * 4096)

    def moved(
        self,
        op: str,
        io_bytes: int,
        qd: int,
        seconds: float,
        allowed: Callable[[], int] | None = None,
    ) -> tuple[int, float]:
        """(bytes, seconds) moved; with `allowed`, an I/O starts only once `allowed()` bytes
        reach its end (it moves what the socket has moved: the socket+device ceiling)."""
        return self._run(op, io_bytes, qd, seconds, None, allowed)

    def _run(
        self,
        op: str,
        io_bytes: int,
        qd: int,
        seconds: float,
        total: int | None,
        allowed: Callable[[], int] | None = None,
    ) -> tuple[int, float]:
        size = NS_BLOCKS * 4096
        slots = itertools.count()  # next() is atomic under the GIL: one I/O per slot
        moved = [0] * qd
        errors: list[OSError] = []
        start = time.perf_counter()

        def worker(i: int) -> None:
            buf = mmap.mmap(-1, io_bytes)  # page-aligned, as O_DIRECT needs
            try:
                with memoryview(buf) as view:
                    first = allowed is None  # free-running: at least one I/O, as the socket
                    while first or time.perf_counter() - start < seconds:
                        first = False
                        offset = next(slots) * io_bytes
                        if total is not None and offset >= total:
                            break
                        while allowed is not None and allowed() < offset + io_bytes:
                            if time.perf_counter() - start >= seconds:
                                return
                            time.sleep(ALLOWED_POLL_S)
                        offset %= size
                        if op == "read":
                            moved[i] += os.preadv(self.fd, [view], offset)
                        else:
                            moved[i] += os.pwritev(self.fd, [view], offset)
            except OSError as e:
                errors.append(e)
            finally:
                buf.close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(qd)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(moved), time.perf_counter() - start

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


ALLOWED_POLL_S = 0.0005  # a rate-matched device I/O waiting for the socket checks this often


def _socket_and_device(
    peer: _CeilingPeer, device: _DeviceCeiling, op: str, io_bytes: int, qd: int, seconds: float
) -> float:
    """Bytes/s that the socket ceiling and the device ceiling keep up together, the device
    moving only what the socket has moved (rate-matched, `qd` I/Os of `io_bytes` at most in
    flight): what a target doing nothing but moving bytes between the socket and the device
    could reach on this machine, where the disk's I/O costs CPU on the same cores the network
    needs (a virtual disk: docs/BENCHMARKS.md). The lower of the two rates."""
    got: list[tuple[int, float] | OSError] = []
    progress = [0]

    def run_device() -> None:
        try:
            got.append(device.moved(op, io_bytes, qd, seconds / ROUNDS, lambda: progress[0]))
        except OSError as e:
            got.append(e)

    t = threading.Thread(target=run_device)
    t.start()
    try:
        sb, st = peer.moved(op, seconds / ROUNDS, progress)
    finally:
        t.join()
    result = got[0]
    if isinstance(result, OSError):
        raise result
    db, dt = result
    return min(sb / st, db / dt)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _SpdkTarget:
    """spdk_tgt serving nsid 1: a crypto vbdev (AES_XTS, random key) over a malloc bdev, and
    with `aio_file` nsid 2: a crypto vbdev over an aio bdev on that file (same key)."""

    def __init__(self, spdk_bin: str, tmp: Path, aio_file: Path | None = None) -> None:
        self.port = _free_port()
        key = os.urandom(64).hex()
        listen = {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1"}
        listen["trsvcid"] = str(self.port)
        cfg = {
            "subsystems": [
                {
                    "subsystem": "accel",
                    "config": [
                        {
                            "method": "accel_crypto_key_create",
                            "params": {
                                "name": "k0",
                                "cipher": "AES_XTS",
                                "key": key[:64],
                                "key2": key[64:],
                            },
                        }
                    ],
                },
                {
                    "subsystem": "bdev",
                    "config": [
                        {
                            "method": "bdev_malloc_create",
                            "params": {"name": "M0", "num_blocks": NS_BLOCKS, "block_size": 4096},
                        },
                        {
                            "method": "bdev_crypto_create",
                            "params": {"base_bdev_name": "M0", "name": "C0", "key_name": "k0"},
                        },
                        *self._aio_bdevs(aio_file),
                    ],
                },
                {
                    "subsystem": "nvmf",
                    "config": [
                        {
                            "method": "nvmf_create_transport",
                            "params": {
                                "trtype": "TCP",
                                "max_io_size": 1 << 20,
                                "io_unit_size": 131072,
                                "in_capsule_data_size": 4096,
                            },
                        },
                        {
                            "method": "nvmf_create_subsystem",
                            "params": {"nqn": NQN, "allow_any_host": True},
                        },
                        {
                            "method": "nvmf_subsystem_add_ns",
                            "params": {"nqn": NQN, "namespace": {"bdev_name": "C0", "nsid": 1}},
                        },
                        *(
                            [
                                {
                                    "method": "nvmf_subsystem_add_ns",
                                    "params": {
                                        "nqn": NQN,
                                        "namespace": {"bdev_name": "C1", "nsid": 2},
                                    },
                                }
                            ]
                            if aio_file is not None
                            else []
                        ),
                        {
                            "method": "nvmf_subsystem_add_listener",
                            "params": {"nqn": NQN, "listen_address": listen},
                        },
                    ],
                },
            ]
        }
        path = tmp / "spdk_tgt.json"
        path.write_text(json.dumps(cfg))
        self.log = tmp / "spdk_tgt.log"
        args = [
            str(Path(spdk_bin, "spdk_tgt")),
            "--no-huge",
            "-s",
            "1024",
            "--no-pci",
            "--disable-cpumask-locks",
            "-m",
            "0x1",
            "-r",
            str(tmp / "spdk.sock"),
            "--json",
            str(path),
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SPDK_START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    tail = self.log.read_text(errors="replace")[-1000:]
                    raise RuntimeError(f"spdk_tgt did not listen: {tail}") from None
                time.sleep(0.1)

    @staticmethod
    def _aio_bdevs(aio_file: Path | None) -> list[dict[str, Any]]:
        """An aio bdev (libaio; SPDK opens the file O_DIRECT where the file system allows)
        on a file of the namespace's size, under a crypto vbdev C1."""
        if aio_file is None:
            return []
        with open(aio_file, "wb") as f:
            f.truncate(NS_BLOCKS * 4096)
        return [
            {
                "method": "bdev_aio_create",
                "params": {"name": "A0", "filename": str(aio_file), "block_size": 4096},
            },
            {
                "method": "bdev_crypto_create",
                "params": {"base_bdev_name": "A0", "name": "C1", "key_name": "k0"},
            },
        ]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """spdk_tgt stopped for the body: its reactor busy-polls a core, which the ceilings
        measured next to its rows would otherwise lose (and the rows then exceed them)."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process would not see SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _measure(
    ctrl: NvmeTcpController, nsid: int, op: str, buf: bytearray, seconds: float
) -> tuple[int, float]:
    """(bytes, seconds) of sequential I/O as fio does it with iodepth=qd: each call moves
    `buf` in commands of the controller's max_transfer_bytes, the queue keeping its depth of
    them in flight (no drain between commands)."""
    blocks = len(buf) // 4096
    lba, moved, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if lba + blocks > NS_BLOCKS:
            lba = 0
        if op == "read":
            ctrl.read(nsid, lba, buf)
        else:
            ctrl.write(nsid, lba, buf)
        lba += blocks
        moved += len(buf)
    return moved, time.perf_counter() - start


def run_bench(
    *,
    seconds: float = 1.0,
    sizes_kib: tuple[int, ...] = (128, 1024),
    qds: tuple[int, ...] = (1, 8),
    queues: int = 1,
    targets: tuple[str, ...] = TARGETS,
    spdk_bin: str | None = None,
    progress: Any = None,
    tier_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Every row is measured right after the socket ceiling in the same direction (this
    machine's load drifts within seconds); its ratio is against that ceiling. `spdk_bin`
    (default: $SPDK_BIN) names SPDK's binaries; without them the spdk rows are left out and
    the report says why. `tier_dir`: the directory (file system) the NVMe-tier files go in
    (a temporary directory under it; default: the system's temporary directory)."""
    seconds = min(seconds, SECONDS_PER_ROW_MAX)
    queues = max(1, min(queues, QUEUES_MAX))
    spdk_bin = spdk_bin if spdk_bin is not None else os.environ.get("SPDK_BIN", "")
    spdk_note = "spdk_tgt from SPDK_BIN, crypto vbdev (AES_XTS, software accel) over malloc"
    spdk_nvme_note = (
        "the same spdk_tgt, nsid 2: crypto vbdev over an aio bdev on a file beside the tier file"
    )
    if any(t in SPDK_TARGETS for t in targets) and not (
        spdk_bin and Path(spdk_bin, "spdk_tgt").exists()
    ):
        targets = tuple(t for t in targets if t not in SPDK_TARGETS)
        spdk_note = "absent: SPDK_BIN does not name SPDK's binaries (see README, the SPDK peer)"
        spdk_nvme_note = spdk_note
    peer = _CeilingPeer()
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="dpukv-bench-nvme-", dir=tier_dir) as tmp:
            tiers = Path(tmp) / "tiers"
            tiers.mkdir()
            devices = {
                name: _DeviceCeiling(tiers / f"device-{name}.img", direct=ROW_DIRECT[name])
                for name in DEVICE_ROWS & set(targets)
            }
            try:
                agent = [t for t in targets if t in AGENT_TARGETS]
                if agent:
                    with TargetProcess(
                        NQN, allow_hosts=[HOSTNQN], blocks=NS_BLOCKS, tiers_dir=tiers
                    ) as t:
                        for name in agent:
                            rows += _target_rows(
                                peer, t.port, name, AGENT_TARGETS[name], sizes_kib, qds, queues,
                                seconds, progress, devices.get(name), contextlib.nullcontext,
                            )  # fmt: skip
                spdk_names = [t for t in targets if t in SPDK_TARGETS]
                if spdk_names:
                    assert spdk_bin
                    aio = tiers / "spdk-nvme.img" if "spdk-nvme" in spdk_names else None
                    spdk = _SpdkTarget(spdk_bin, Path(tmp), aio)
                    try:
                        for name in spdk_names:
                            rows += _target_rows(
                                peer, spdk.port, name, SPDK_TARGETS[name], sizes_kib, qds,
                                queues, seconds, progress, devices.get(name), spdk.paused,
                            )  # fmt: skip
                    finally:
                        spdk.close()
            finally:
                for device in devices.values():
                    device.close()
    finally:
        peer.close()
    _pair_with_spdk(rows)
    above = [_describe(r) for r in rows if r.get("ceilings_exceeded")]
    if above:
        raise CeilingExceeded("rows above their own ceiling: " + "; ".join(above))
    return {
        "socket_ceiling_gbps": round(statistics.median(r["ceiling_gbps"] for r in rows), 3),
        "targets": {
            "agent-dram": "python -m dpu_agent.nvmf --tiers-dir: the agent's DRAM tier "
            "(CryptoBlockDevice over MemoryBlockDevice), nsid 1, MDTS 1 MiB",
            "agent-nvme": "the same process: the agent's NVMe tier (CryptoBlockDevice over "
            "FileBlockDevice), nsid 2",
            "spdk": spdk_note,
            "spdk-nvme": spdk_nvme_note,
        },
        "tier_dir": str(Path(tier_dir) if tier_dir is not None else tempfile.gettempdir()),
        "device_ceiling": "pwritev/preadv of io_kib, qd threads, on a file beside the tier "
        "file, doing the row's kind of I/O (device_io)",
        "initiator": f"host_shim.nvme in this process, {queues} I/O queue(s) of depth qd",
        "seconds_per_row": seconds,
        "results": rows,
    }


class CeilingExceeded(RuntimeError):
    """A row above one of its own ceilings in the median of its slices: not a ceiling."""


def _describe(r: dict[str, Any]) -> str:
    return f"{r['target']} {r['op']} {r['io_kib']} KiB QD{r['qd']} {r['gbps']} GB/s > " + ", ".join(
        r["ceilings_exceeded"]
    )


def _pair_with_spdk(rows: list[dict[str, Any]]) -> None:
    """`vs_spdk` on agent rows: over SPDK's row of the same op, size, depth and queues, on the
    same kind of store (the same file I/O for the NVMe tier), else a note saying why not."""
    by_key = {(r["target"], r["op"], r["io_kib"], r["qd"], r["queues"]): r for r in rows}
    for r in rows:
        pair = SAME_STORE_SPDK.get(r["target"])
        base = by_key.get((pair, r["op"], r["io_kib"], r["qd"], r["queues"]))
        if base is None or base["gbps"] <= 0:
            continue
        if r.get("device_io") != base.get("device_io"):
            r["vs_spdk_note"] = (
                f"no vs_spdk: {r['target']} does {r['device_io']} file I/O, {pair} "
                f"{base['device_io']} (tier files on tmpfs, --dir /dev/shm, compare the same)"
            )
            continue
        r["vs_spdk"] = round(r["gbps"] / base["gbps"], 3)


def _target_rows(
    peer: _CeilingPeer,
    port: int,
    target: str,
    nsid: int,
    sizes_kib: tuple[int, ...],
    qds: tuple[int, ...],
    queues: int,
    seconds: float,
    progress: Any,
    device: _DeviceCeiling | None,
    pause: Callable[[], contextlib.AbstractContextManager[None]],
) -> list[dict[str, Any]]:
    out = []
    for io_kib in sizes_kib:
        for qd in qds:
            rows = _rows(peer, port, target, nsid, io_kib, qd, queues, seconds, device, pause)
            for row in rows:
                out.append(row)
                if progress is not None:
                    progress(row)
    return out


def _rows(
    peer: _CeilingPeer,
    port: int,
    target: str,
    nsid: int,
    io_kib: int,
    qd: int,
    queues: int,
    seconds: float,
    device: _DeviceCeiling | None,
    pause: Callable[[], contextlib.AbstractContextManager[None]],
) -> list[dict[str, Any]]:
    """The write and read rows of one size and depth. `pause()`: held while the ceilings run
    (spdk_tgt stopped, so that its busy-polling reactor does not slow them)."""
    ctrl = NvmeTcpController.connect(
        "127.0.0.1",
        port,
        NQN,
        HOSTNQN,
        io_queues=queues,
        queue_depth=max(2, qd),
        max_transfer_bytes=io_kib << 10,
    )
    out = []
    buf = bytearray(max(SPAN_BYTES, (io_kib << 10) * qd * queues))
    try:
        for op in ("write", "read"):
            # Interleaved slices of ceiling and NVMe: load that drifts hits both alike, and the
            # median of the slices' ratios ignores a slice that another job stalled.
            ceilings, nvmes, devices, joints = [], [], [], []
            for _ in range(ROUNDS):
                with pause():
                    ceilings.append(peer.moved(op, seconds / ROUNDS))
                nvmes.append(_measure(ctrl, nsid, op, buf, seconds / ROUNDS))
                if device is not None:
                    with pause():
                        devices.append(
                            device.moved(op, io_kib << 10, qd * queues, seconds / ROUNDS)
                        )
                        joints.append(_socket_and_device(
                            peer, device, op, io_kib << 10, qd * queues, seconds
                        ))  # fmt: skip
            ratio = statistics.median(
                (b / t) / (cb / ct) for (b, t), (cb, ct) in zip(nvmes, ceilings, strict=True)
            )
            ceiling = sum(b for b, _ in ceilings) / sum(t for _, t in ceilings) / 1e9
            gbps = sum(b for b, _ in nvmes) / sum(t for _, t in nvmes) / 1e9
            row = NvmeBenchRow(
                target=target,
                op=op,
                io_kib=io_kib,
                qd=qd,
                queues=queues,
                encrypted=True,
                gbps=round(gbps, 3),
                ratio=round(ratio, 3),
            )
            extra: dict[str, Any] = {"ceiling_gbps": round(ceiling, 3)}
            if device is not None:
                extra["device_io"] = device.kind
                extra["device_ceiling_gbps"] = round(
                    sum(b for b, _ in devices) / sum(t for _, t in devices) / 1e9, 3
                )
                extra["vs_device"] = round(
                    statistics.median(
                        (b / t) / (db / dt) for (b, t), (db, dt) in zip(nvmes, devices, strict=True)
                    ),
                    3,
                )
                # a rate-matched device may move nothing in a slice a loaded box starved (it
                # waits for the socket): such a slice measured no bound, so it counts neither
                # in the ceiling nor in the ratio; none at all gives None for both
                measured = [j for j in joints if j > 0]
                extra["socket_device_gbps"] = (
                    round(statistics.median(measured) / 1e9, 3) if measured else None
                )
                vs = [(b / t) / j for (b, t), j in zip(nvmes, joints, strict=True) if j > 0]
                extra["vs_socket_device"] = round(statistics.median(vs), 3) if vs else None
            out.append(_bounded({**asdict(row), **extra}))
    finally:
        ctrl.close()
    return out


# Each ceiling of a row and the median of its slices' ratios to it
CEILING_RATIOS = {
    "ceiling_gbps": "ratio",
    "device_ceiling_gbps": "vs_device",
}
# A row above a ceiling by at most this on both measures is not a fault: the socket ceiling's
# peer is Python polling a socket, SPDK's a C reactor; on CI's loaded 2-core box SPDK's 1 MiB
# QD8 writes once measured 1.08x the ceiling over all slices, 1.02x in the median (here
# 0.62-0.73x). The faults this check found were 1.1-1.7x.
CEILING_TOLERANCE = 0.05


def _bounded(row: dict[str, Any]) -> dict[str, Any]:
    """The row, judged against each of its ceilings on both measures: its GB/s over all its
    slices against the ceiling's, and the median of the slices' ratios against 1. Above on one
    measure only, the machine's load moved between the alternated slices: the row carries
    `ceiling_exceeded_reason` saying so. Above on both by at most CEILING_TOLERANCE: within
    what two peers of the same design differ by on a loaded box (reason too). Above on both by
    more, that ceiling does not bound the row: `ceilings_exceeded`, and the bench fails."""
    reasons, exceeded = [], []
    for ceiling, ratio in CEILING_RATIOS.items():
        bound = row.get(ceiling)
        if bound is None:
            continue
        median = row.get(ratio)
        over_all = row["gbps"] > bound
        over_median = median is None or median > 1.0
        if over_all and over_median:
            if median is not None and (
                row["gbps"] <= bound * (1 + CEILING_TOLERANCE) or median <= 1 + CEILING_TOLERANCE
            ):
                reasons.append(
                    f"{ceiling}: {row['gbps']} > {bound} GB/s, median of the slice ratios "
                    f"({ratio}) {median}: within the ceiling's {CEILING_TOLERANCE:.0%} tolerance"
                )
            else:
                exceeded.append(f"{ceiling} {bound} ({ratio} {median})")
        elif over_all:
            reasons.append(
                f"{ceiling}: all slices together {row['gbps']} > {bound} GB/s, but the median "
                f"of the slice ratios ({ratio}) is {median}: load moved between slices"
            )
        elif over_median and median is not None:
            reasons.append(
                f"{ratio}: the median of the slice ratios is {median}, but all slices "
                f"together {row['gbps']} <= {bound} GB/s ({ceiling}): load moved between slices"
            )
    if reasons:
        row["ceiling_exceeded_reason"] = "; ".join(reasons)
    if exceeded:
        row["ceilings_exceeded"] = exceeded
    return row


def _line(r: dict[str, Any]) -> str:
    vs = f"  {r['vs_spdk']:.2f}x SPDK" if "vs_spdk" in r else ""
    if "device_ceiling_gbps" in r:
        vs += f"  {r['vs_device']:.2f}x {r['device_io']} device"
        vs += f" ({r['device_ceiling_gbps']:.2f} GB/s)"
        joint, bound = r["vs_socket_device"], r["socket_device_gbps"]
        vs += f"  {'n/a' if joint is None else f'{joint:.2f}x'} socket+device"
        vs += f" ({'n/a' if bound is None else f'{bound:.2f}'} GB/s)"
    if r.get("ceiling_exceeded_reason"):
        vs += f"  [above a ceiling: {r['ceiling_exceeded_reason']}]"
    if r.get("ceilings_exceeded"):
        vs += f"  [ABOVE ITS CEILING: {', '.join(r['ceilings_exceeded'])}]"
    return (
        f"{r['target']:10} {r['op']:5} {r['io_kib']:5} KiB QD{r['qd']:<3} x{r['queues']} "
        f"{r['gbps']:6.2f} GB/s  {r['ratio']:.2f}x ceiling{vs}"
    )


@click.command(
    "nvme",
    help="NVMe/TCP GB/s of the agent's encrypted namespaces, and SPDK's target when SPDK_BIN "
    "names it, vs a socket pair.",
)
@click.option("--json", "as_json", is_flag=True, help="print the JSON report")
@click.option(
    "--seconds",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.05, SECONDS_PER_ROW_MAX),
    help=f"seconds per row (at most {SECONDS_PER_ROW_MAX:g})",
)
@click.option(
    "--queues",
    default=1,
    show_default=True,
    type=click.IntRange(1, QUEUES_MAX),
    help="I/O queues of the initiator",
)
@click.option("--no-spdk", is_flag=True, help="leave out SPDK's target")
@click.option("--security", is_flag=True, help="add the auth/tls rows (1 MiB QD8, vs plain)")
@click.option(
    "--dir",
    "tier_dir",
    type=click.Path(exists=True, file_okay=False, writable=True),
    default=None,
    help="directory for the NVMe-tier files (default: the temporary directory)",
)
def nvme(
    as_json: bool, seconds: float, queues: int, no_spdk: bool, security: bool, tier_dir: str | None
) -> None:
    targets = tuple(t for t in TARGETS if not (no_spdk and t in SPDK_TARGETS))

    def progress(row: dict[str, Any]) -> None:
        click.echo(_line(row), err=as_json)  # progress on stderr under --json

    try:
        report = run_bench(
            seconds=seconds, queues=queues, targets=targets, progress=progress, tier_dir=tier_dir
        )
        if security:  # DH-HMAC-CHAP / TLS cost (dpu_agent/bench/nvme_security.py)
            report["security"] = security_rows(seconds)
    except (NvmeError, OSError, RuntimeError) as e:  # a target died or refused: say so, exit 1
        if as_json:
            click.echo(json.dumps({"ok": False, "error": str(e), "exit_code": 1}))
        else:
            click.echo(f"bench nvme failed: {e}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"socket ceiling {report['socket_ceiling_gbps']:.2f} GB/s; spdk: "
               f"{report['targets']['spdk']}")  # fmt: skip
    for r in report["results"]:
        if "vs_spdk" in r or "device_ceiling_gbps" in r:
            click.echo(_line(r))
    if security:
        print_rows(report["security"], click.echo)
