"""`dpuctl bench datapath`: end-to-end put/get GB/s through a real agent over each transport
(NVMe/TCP, NIXL), next to raw NIXL, Mooncake's transfer engine, Redis and the ceiling of plain
sockets, plus control-plane lookup latency.

In one run on one machine (figures move 2-3x between runs, docs/MEASURED.md):

- agent: a `dpuctl agent run` child on loopback ports; KVClient puts and gets 32 MiB chunks
  (a Llama-3-8B-shaped layout: 32 layers x K/V x 8 KV heads x 256 tokens x 128 dims, fp16)
  through the control plane, NVMe/TCP with several I/O queues, AES-XTS and checksums;
- agent over NIXL (`--transport nixl`, or `all` where NIXL is installed): the same puts and gets,
  the agent WRITEs/READs the client's registered buffers (UCX; `UCX_TLS=tcp` unless set, so the
  bytes take TCP as between a host and its DPU without RDMA, not shared memory);
- raw NIXL (`nixl_raw_gbps`) and Mooncake's transfer engine (TCP): a child writing the same bytes
  into this process's registered buffers, no tier (bench._peers);
- redis: a `redis-server` child (no persistence, loopback) with redis-py + hiredis doing SET and
  GET of the same bytes over as many connections as the agent has streams (I/O queues), each
  pipelining its share; `redis_*_1stream_gbps`: one connection, one command at a time;
- socket ceiling: as many TCP loopback pairs as streams, `sendall` into `recv_into` a
  preallocated buffer in other threads; `socket_ceiling_1stream_gbps`: one pair
  (`socket_xproc_gbps`: one pair, the receiver in another process, for context);
- host CPU: `host_cpu_s_per_gib` is this (client) process's user+system CPU seconds (rusage)
  over the put and get calls per GiB moved, NIXL's progress thread included; `host_copies` is
  how many times the shim's own code copies each chunk's bytes (NVMe/TCP: recv_into the
  caller's buffer, 1; NIXL: 0, the bytes land from the transport);
- lookup: p50/p99 of 64-key lookups (control-plane round trip over TCP, keys precomputed; the
  p50 over the Unix socket too), next to the round trip to a bare asyncio echo server in
  another process (`rtt_floor_p50_us`).

Every path takes its turn within each round (so the machine's load hits all three
alike); one unmeasured warm-up round; GB/s is the median of the measured rounds.

`--nixl-ab` measures only NIXL get through the agent against raw NIXL: the same chunks, sizes
and one stream each, raw then agent in every round (put before the agent's turn, untimed), the
ratio per round and its median, min and max, with the CPU seconds per GiB both sides spent
(this process, the raw initiator child; the agent and its NIXL worker; inside the agent its
decrypting threads and its lane threads, by the names it gives them) and the cores each kept
busy (CPU seconds / wall seconds), to say where time goes on a box whose cores are the
bottleneck.

`--lookup-only` measures only the lookup latencies and the echo floor (no put/get rounds, no
Redis): `dpuctl bench datapath --lookup-only --json`, a few seconds, for control-plane work.

GB/s = 10^9 bytes/s. Every get is checked byte-exact against what was put.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np

from dpu_agent.bench import _peers
from dpu_agent.testing import spawn_agent
from host_shim.client import ControlChannel, NodeClient
from host_shim.transport import nixl_status
from kvproto.keys import ChunkLayout

__all__ = [
    "datapath",
    "redis_server",
    "run_datapath",
    "run_lookup",
    "run_nixl_ab",
    "socket_ceiling",
    "socket_xproc",
]

LAYOUT = ChunkLayout("bench-llama3-8b", "float16", 32, 8, 128, chunk_tokens=256)  # 32 MiB
ROUNDS_MAX = 10  # each round moves chunks x 32 MiB both ways; bounded run time
CHUNKS_MAX = 16  # 512 MiB per round: client memory and the agent's DRAM tier bound it
LOOKUPS_MAX = 20000
REDIS_START_TIMEOUT_S = 10.0
TRANSPORT_CHOICES = ("all", "nvme-tcp", "nixl")
# the shim's own copies of a chunk's bytes per path (see the module docstring)
HOST_COPIES = {"nvme-tcp": 1, "nixl": 0}
_PREFIX = {"nvme-tcp": "", "nixl": "nixl_"}  # report keys: put_gbps (NVMe/TCP), nixl_put_gbps


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SINK = """
import socket, sys
size, count = int(sys.argv[1]), int(sys.argv[2])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
view = memoryview(bytearray(size))
for _ in range(count):
    got = 0
    while got < size:
        n = conn.recv_into(view[got:])
        assert n > 0, "sender closed early"
        got += n
conn.sendall(b"k")
"""


def socket_ceiling(nbytes: int, message_bytes: int = 32 << 20) -> float:
    """GB/s of a blocking TCP loopback pair moving `nbytes` in `message_bytes` messages:
    `sendall` from this thread into `recv_into` a preallocated buffer in another thread (as
    docs/MEASURED.md measures it: the stricter figure, no process switch in the way)."""
    srv = socket.create_server(("127.0.0.1", 0))
    payload = np.random.default_rng(1).integers(0, 255, message_bytes, dtype=np.uint8)
    sink = memoryview(bytearray(message_bytes))
    count = max(1, nbytes // message_bytes)

    def receiver(conn: socket.socket) -> None:
        for _ in range(count):
            got = 0
            while got < message_bytes:
                n = conn.recv_into(sink[got:])
                assert n > 0, "sender closed early"
                got += n
        conn.sendall(b"k")

    client = socket.create_connection(srv.getsockname()[:2])
    conn, _ = srv.accept()
    t = threading.Thread(target=receiver, args=(conn,), daemon=True)
    t0 = time.perf_counter()
    t.start()
    for _ in range(count):
        client.sendall(payload.data)
    client.recv(1)
    seconds = time.perf_counter() - t0
    t.join(10)
    for s in (client, conn, srv):
        s.close()
    return _gbps(count * message_bytes, seconds)


def socket_xproc(nbytes: int, message_bytes: int = 32 << 20) -> float:
    """The same pair with the receiver in another process, as the agent is (for context)."""
    count = max(1, nbytes // message_bytes)
    payload = np.random.default_rng(1).integers(0, 255, message_bytes, dtype=np.uint8)
    proc = subprocess.Popen([sys.executable, "-c", _SINK, str(message_bytes), str(count)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as client:
            t0 = time.perf_counter()
            for _ in range(count):
                client.sendall(payload.data)
            client.recv(1)
            seconds = time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait(10)
    return _gbps(count * message_bytes, seconds)


_ECHO_SERVER = """
import asyncio
class Echo(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, d): self.t.write(d)
async def main():
    s = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(s.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def rtt_floor_us(count: int, nbytes: int = 1200) -> float:
    """p50 round trip to a bare asyncio echo server in another process: what any Python
    control plane pays on this machine before doing any work (a 64-key lookup is ~1.2 KB)."""
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        samples = []
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * nbytes
            for _ in range(count):
                t0 = time.perf_counter()
                s.sendall(msg)
                got = 0
                while got < nbytes:
                    got += len(s.recv(65536))
                samples.append(time.perf_counter() - t0)
    finally:
        proc.kill()
        proc.wait(10)
    return round(sorted(samples)[len(samples) // 2] * 1e6, 1)


@contextlib.contextmanager
def redis_server() -> Iterator[Any]:
    """A fresh redis-server child (loopback, no persistence) and a redis-py client of it."""
    import redis  # the agent extra's baseline client (hiredis parser when installed)

    binary = shutil.which("redis-server")
    if binary is None:
        raise click.ClickException("redis-server is not installed: apt-get install redis-server")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield r
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _redis_round(r: Any, chunks: list[np.ndarray], rnd: int) -> tuple[float, float]:
    """Seconds for SET then GET of every chunk."""
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        r.set(f"k{rnd}:{i}", c.reshape(-1).view(np.uint8).data)
    t1 = time.perf_counter()
    for i, c in enumerate(chunks):
        got = r.get(f"k{rnd}:{i}")
        assert got is not None and len(got) == c.nbytes
    t2 = time.perf_counter()
    r.flushall()
    return t1 - t0, t2 - t1


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _agent_round(
    client: NodeClient, chunks: list[np.ndarray], out: list[np.ndarray], rnd: int
) -> tuple[float, float, float]:
    """Seconds for put then get of every chunk (a new prompt each round), byte-exact, and this
    process's CPU seconds over both calls."""
    n = len(chunks)
    tokens = np.arange(n * LAYOUT.chunk_tokens, dtype=np.uint32) + (rnd + 1) * 1_000_003
    for o in out:
        o.fill(0)  # a stale buffer would pass the byte-exact check without a transfer
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    stored = client.put(tokens, chunks)
    t1 = time.perf_counter()
    assert stored == n, f"put stored {stored} of {n} chunks"
    loaded = client.get(tokens, out)
    t2 = time.perf_counter()
    cpu = _cpu_s() - cpu0
    assert loaded == n, f"get loaded {loaded} of {n} chunks"
    for a, b in zip(chunks, out, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "get is not byte-exact"
    client.delete(tokens)
    return t1 - t0, t2 - t1, cpu


def _round(ctx: dict[str, Any], rnd: int) -> dict[str, float]:
    """One turn of every path; seconds (or GB/s for the socket figures) by report key."""
    data, out, streams = ctx["data"], ctx["out"], ctx["streams"]
    nbytes = sum(c.nbytes for c in data)
    got: dict[str, float] = {}
    for transport, client in ctx["clients"].items():
        p = _PREFIX[transport]
        got[p + "put"], got[p + "get"], got[p + "cpu"] = _agent_round(client, data, out, rnd)
    for name, peer in ctx["peers"].items():
        got[name] = peer.round_s()
    if "lmcache" in ctx:
        got["lm_put"], got["lm_get"] = ctx["lmcache"].round_values()
    got["set"], got["rget"] = _peers.redis_streams_round(ctx["redis_clients"], data, rnd)
    got["set1"], got["rget1"] = _redis_round(ctx["redis"], data, rnd)
    got["ceiling"] = _peers.socket_ceiling_streams(nbytes, streams)
    got["ceiling1"] = socket_ceiling(nbytes)
    got["xproc"] = socket_xproc(nbytes)
    return got


def _interleaved(ctx: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Every path takes its turn each round, so load on the machine hits all alike; round -1
    warms up (first touch of the tiers, buffers, connections) and is dropped."""
    nbytes = sum(c.nbytes for c in ctx["data"])
    samples: dict[str, list[float]] = {}
    for rnd in range(-1, rounds):
        got = _round(ctx, rnd)
        if rnd >= 0:
            for k, v in got.items():
                samples.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in samples.items()}
    report: dict[str, Any] = {}
    for transport in ctx["clients"]:
        p = _PREFIX[transport]
        report[p + "put_gbps"] = _gbps(nbytes, med[p + "put"])
        report[p + "get_gbps"] = _gbps(nbytes, med[p + "get"])
        report[p + "host_cpu_s_per_gib"] = round(med[p + "cpu"] / (2 * nbytes / (1 << 30)), 3)
        report[p + "host_copies"] = HOST_COPIES[transport]
    for name in ctx["peers"]:
        report[f"{name}_gbps"] = _gbps(nbytes, med[name])
    if "lmcache" in ctx:
        report["lmcache_put_gbps"] = _gbps(nbytes, med["lm_put"])
        report["lmcache_get_gbps"] = _gbps(nbytes, med["lm_get"])
    report |= {
        "redis_set_gbps": _gbps(nbytes, med["set"]),
        "redis_get_gbps": _gbps(nbytes, med["rget"]),
        "redis_set_1stream_gbps": _gbps(nbytes, med["set1"]),
        "redis_get_1stream_gbps": _gbps(nbytes, med["rget1"]),
        "socket_ceiling_gbps": med["ceiling"],
        "socket_ceiling_1stream_gbps": med["ceiling1"],
        "socket_xproc_gbps": med["xproc"],
    }
    return report


def _percentiles(channel: ControlChannel, keys: list[bytes], count: int) -> tuple[float, float]:
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        channel.call("lookup", keys=keys, lease=False)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return round(samples[len(samples) // 2] * 1e6, 1), round(
        samples[int(len(samples) * 0.99)] * 1e6, 1
    )


def _lookup_latency(client: NodeClient, unix_url: str, token: str, count: int) -> dict[str, Any]:
    """64-key lookups (4 hits) over TCP, and over the Unix socket (a co-located client)."""
    tokens = np.arange(64 * LAYOUT.chunk_tokens, dtype=np.uint32)
    client.put(tokens[: 4 * LAYOUT.chunk_tokens], [np.zeros(LAYOUT.chunk_shape, np.float16)] * 4)
    keys = client.keys(tokens)
    p50, p99 = _percentiles(client.channel, keys, count)
    with ControlChannel(unix_url, "default", token) as unix:
        unix.connect()
        unix_p50, _ = _percentiles(unix, keys, count)
    return {"lookup_p50_us": p50, "lookup_p99_us": p99, "lookup_unix_p50_us": unix_p50,
            "lookup_keys": len(keys)}  # fmt: skip


def _transports(wanted: str) -> list[str]:
    """The agent paths to measure; `all` is NVMe/TCP plus NIXL where NIXL loads here."""
    if wanted == "nixl" and not nixl_status()["available"]:
        raise click.ClickException(f"--transport nixl: {nixl_status()['reason']}")
    if wanted == "all":
        return ["nvme-tcp"] + (["nixl"] if nixl_status()["available"] else [])
    return [wanted]


def _ucx_env() -> dict[str, str]:
    """UCX over TCP unless the caller chose (a host and its DPU are two machines: no shm)."""
    return {"UCX_TLS": os.environ.get("UCX_TLS", "tcp")}


@contextlib.contextmanager
def _agent_client(
    io_queues: int, transports: tuple[str, ...] = ("nvme-tcp",)
) -> Iterator[tuple[Any, dict[str, NodeClient]]]:
    """A fresh agent child (DRAM tier sized for the largest run, metrics off) and one client
    per transport."""
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-") as tmp, contextlib.ExitStack() as st:
        env = {"DPUKV_STORAGE_DRAM_BYTES": str(2 * CHUNKS_MAX * LAYOUT.chunk_bytes),
               "DPUKV_METRICS_ENABLED": "false", **_ucx_env()}  # fmt: skip
        os.environ.update(_ucx_env())  # this process's NIXL agents too
        agent = spawn_agent(Path(tmp) / "var", env=env)
        st.callback(agent.stop)
        salt = b"bench-salt-0123456789"
        clients = {}
        for t in transports:
            client = NodeClient(agent.control_url, "default", agent.token, LAYOUT, salt,
                               io_queues=io_queues, transport=t)  # fmt: skip
            clients[t] = st.enter_context(client)
        yield agent, clients


def _start_peers(ctx: dict[str, Any], st: contextlib.ExitStack) -> dict[str, str]:
    """Raw NIXL and Mooncake next to the agent (where installed); the reasons for the missing."""
    chunks, chunk = len(ctx["data"]), LAYOUT.chunk_bytes
    env = {**os.environ, **_ucx_env()}
    skipped: dict[str, str] = {}
    ctx["peers"] = {}
    if "nixl" in ctx["clients"]:
        pool = np.zeros((chunks, chunk), np.uint8)
        peer = _peers.NixlRawPeer(pool, chunk, chunks, env)
        st.callback(peer.close)
        ctx["peers"]["nixl_raw"] = peer
    if _peers.mooncake_available():
        pool = np.zeros((chunks, chunk), np.uint8)
        mc = _peers.MooncakePeer(pool, chunk, chunks, env)
        st.callback(mc.close)
        ctx["peers"]["mooncake"] = mc
    else:
        skipped["mooncake"] = "not installed: pip install mooncake-transfer-engine-non-cuda"
    python, why = _peers.lmcache_python()
    if python is None:
        skipped["lmcache"] = why
    else:
        lm = _peers.LmcachePeer(python, chunk, chunks, ctx["streams"])
        st.callback(lm.close)
        ctx["lmcache"] = lm
    return skipped


def run_datapath(
    *,
    chunks: int = 8,
    rounds: int = 3,
    io_queues: int = 4,
    lookups: int = 2000,
    transport: str = "all",
) -> dict[str, Any]:
    assert 1 <= chunks <= CHUNKS_MAX and 1 <= rounds <= ROUNDS_MAX, (chunks, rounds)
    assert 1 <= lookups <= LOOKUPS_MAX, lookups
    transports = _transports(transport)
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
            for _ in range(chunks)]  # fmt: skip
    report: dict[str, Any] = {"chunk_bytes": LAYOUT.chunk_bytes, "chunks": chunks,
                              "rounds": rounds, "io_queues": io_queues, "streams": io_queues,
                              "transport": "+".join(transports),
                              "ucx_tls": _ucx_env()["UCX_TLS"]}  # fmt: skip
    with contextlib.ExitStack() as st:
        agent, clients = st.enter_context(_agent_client(io_queues, tuple(transports)))
        r = st.enter_context(redis_server())
        port = int(r.connection_pool.connection_kwargs["port"])
        ctx: dict[str, Any] = {"data": data, "out": [np.empty_like(c) for c in data],
                               "streams": io_queues, "clients": clients, "redis": r,
                               "redis_clients": st.enter_context(
                                   _peers.redis_clients(port, io_queues))}  # fmt: skip
        report["skipped"] = _start_peers(ctx, st)
        report |= _interleaved(ctx, rounds)
        report["transport_reason"] = {t: c._xport.reason or "asked" for t, c in clients.items()}
        first = clients.get("nvme-tcp") or next(iter(clients.values()))
        report |= _lookup_latency(first, agent.unix_url, agent.token, lookups)
        report["rtt_floor_p50_us"] = rtt_floor_us(lookups)
    return report | _ratios(report)


def _proc_cpu_s(pids: list[int]) -> float:
    """CPU seconds of these processes' live threads (`_threads_cpu_s`, in nanoseconds): /proc's
    stat counts 10 ms ticks, and a small get's NIXL worker spends less than one (a 1-chunk
    round read 0.0 s/GiB). The pools measured keep their threads for the whole run; a thread
    that ends between two reads would take its time with it."""
    return sum(sum(_threads_cpu_s(pid).values()) for pid in pids)


def _threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live threads, summed by thread name (the agent names its NIXL
    threads: nixl-io decrypts and hashes, nixl-lane and nixl-link drive transfers). Read from
    /proc/PID/task/TID/schedstat (nanoseconds on a CPU): /proc's stat counts 10 ms ticks, which
    over one round's 256 MiB is +-0.04 s/GiB, the size of the lanes' whole share."""
    tick, out = os.sysconf("SC_CLK_TCK"), dict[str, float]()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                stat = (task / "stat").read_text()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                try:
                    cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
                except (OSError, IndexError, ValueError):  # a kernel without sched_info
                    fields = stat.rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / tick
                out[name] = out.get(name, 0.0) + cpu
    return out


def _agent_pids(agent: Any) -> list[int]:
    """The agent and its NIXL worker child."""
    pids = [agent.proc.pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{agent.proc.pid}/task").iterdir():
            pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def _decrypt_hash_cpu_s_per_gib(nbytes: int) -> float:
    """CPU seconds per GiB of what the agent adds to a NIXL get, alone: AES-XTS decryption of
    the DRAM tier's ciphertext into a 4 MiB segment with the xxh3 inside the same pass
    (CryptoBlockDevice.read_hashed_into, as the agent's I/O threads), one thread."""
    from dpu_agent.blockdev import BLOCK_SIZE, MemoryBlockDevice
    from dpu_agent.crypto.blockdev import CryptoBlockDevice
    from dpu_agent.crypto.xts import XtsCipher, Xxh3

    seg = 4 << 20
    nbytes = max(seg, nbytes // seg * seg)
    dev = CryptoBlockDevice(MemoryBlockDevice(nbytes // BLOCK_SIZE), XtsCipher(os.urandom(64)))
    plain = np.random.default_rng(1).integers(0, 255, seg, dtype=np.uint8).data
    for off in range(0, nbytes, seg):
        dev.write(off // BLOCK_SIZE, plain)
    buf, hasher = memoryview(bytearray(seg)), Xxh3(b"key")
    cpu0 = _cpu_s()
    for off in range(0, nbytes, seg):
        dev.read_hashed_into(off // BLOCK_SIZE, buf, hasher, seg)
    return round((_cpu_s() - cpu0) / (nbytes / (1 << 30)), 3)


def run_nixl_ab(*, chunks: int = 8, rounds: int = 7) -> dict[str, Any]:
    """NIXL get through the agent against raw NIXL, alternating in every round (module doc)."""
    assert 1 <= chunks <= CHUNKS_MAX and 1 <= rounds <= ROUNDS_MAX, (chunks, rounds)
    _transports("nixl")  # a clear error where NIXL is not installed
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
            for _ in range(chunks)]  # fmt: skip
    out = [np.empty_like(c) for c in data]
    nbytes = sum(c.nbytes for c in data)
    gib = nbytes / (1 << 30)
    rows: list[dict[str, float]] = []
    with contextlib.ExitStack() as st:
        agent, clients = st.enter_context(_agent_client(4, ("nixl",)))
        client = clients["nixl"]
        pool = np.zeros((chunks, LAYOUT.chunk_bytes), np.uint8)
        raw = _peers.NixlRawPeer(pool, LAYOUT.chunk_bytes, chunks, {**os.environ, **_ucx_env()})
        st.callback(raw.close)
        for rnd in range(-1, rounds):  # round -1 warms up both and is dropped
            here, child = _cpu_s(), _proc_cpu_s([raw.child.proc.pid])
            raw_s = raw.round_s()
            raw_cpu = _cpu_s() - here + _proc_cpu_s([raw.child.proc.pid]) - child
            tokens = np.arange(chunks * LAYOUT.chunk_tokens, dtype=np.uint32) + (rnd + 1) * 7919
            assert client.put(tokens, data) == chunks
            for o in out:
                o.fill(0)
            pids = _agent_pids(agent)  # the agent, then its NIXL worker
            here, main, worker = _cpu_s(), _proc_cpu_s(pids[:1]), _proc_cpu_s(pids[1:])
            threads = _threads_cpu_s(pids[0])
            t0 = time.perf_counter()
            loaded = client.get(tokens, out)
            get_s = time.perf_counter() - t0
            host_cpu = _cpu_s() - here
            agent_cpu = _proc_cpu_s(pids[:1]) - main
            worker_cpu = _proc_cpu_s(pids[1:]) - worker
            after = _threads_cpu_s(pids[0])
            io_cpu = after.get("nixl-io", 0.0) - threads.get("nixl-io", 0.0)
            lane_cpu = sum(after.get(n, 0.0) - threads.get(n, 0.0)
                           for n in ("nixl-lane", "nixl-link", "nixl-watchdog"))  # fmt: skip
            get_cpu = host_cpu + agent_cpu + worker_cpu
            assert loaded == chunks, f"get loaded {loaded} of {chunks}"
            for a, b in zip(data, out, strict=True):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "get not byte-exact"
            client.delete(tokens)
            if rnd >= 0:
                rows.append({"raw_gbps": _gbps(nbytes, raw_s), "get_gbps": _gbps(nbytes, get_s),
                             "ratio": round(raw_s / get_s, 3),
                             "raw_cpu_s_per_gib": round(raw_cpu / gib, 3),
                             "get_cpu_s_per_gib": round(get_cpu / gib, 3),
                             "get_host_cpu_s_per_gib": round(host_cpu / gib, 3),
                             "get_agent_cpu_s_per_gib": round(agent_cpu / gib, 3),
                             "get_agent_io_cpu_s_per_gib": round(io_cpu / gib, 3),
                             "get_agent_lane_cpu_s_per_gib": round(lane_cpu / gib, 3),
                             "get_worker_cpu_s_per_gib": round(worker_cpu / gib, 3),
                             "raw_cores": round(raw_cpu / raw_s, 2),
                             "get_cores": round(get_cpu / get_s, 2)})  # fmt: skip
    ratios = [r["ratio"] for r in rows]

    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in rows), 3)

    return {"chunk_bytes": LAYOUT.chunk_bytes, "chunks": chunks, "rounds": rounds,
            "streams": 1, "ucx_tls": _ucx_env()["UCX_TLS"], "per_round": rows,
            "nixl_raw_gbps": med("raw_gbps"), "nixl_get_gbps": med("get_gbps"),
            "nixl_get_vs_raw": round(statistics.median(ratios), 3),
            "nixl_get_vs_raw_min": min(ratios), "nixl_get_vs_raw_max": max(ratios),
            "raw_cpu_s_per_gib": med("raw_cpu_s_per_gib"),
            "get_cpu_s_per_gib": med("get_cpu_s_per_gib"),
            "get_host_cpu_s_per_gib": med("get_host_cpu_s_per_gib"),
            "get_agent_cpu_s_per_gib": med("get_agent_cpu_s_per_gib"),
            "get_agent_io_cpu_s_per_gib": med("get_agent_io_cpu_s_per_gib"),
            "get_agent_lane_cpu_s_per_gib": med("get_agent_lane_cpu_s_per_gib"),
            "get_worker_cpu_s_per_gib": med("get_worker_cpu_s_per_gib"),
            "raw_cores": med("raw_cores"), "get_cores": med("get_cores"),
            "decrypt_hash_cpu_s_per_gib": _decrypt_hash_cpu_s_per_gib(nbytes),
            "loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}  # fmt: skip


def run_lookup(*, lookups: int = 2000) -> dict[str, Any]:
    """Only the lookup figures of run_datapath (same agent, keys and hits) and the echo floor."""
    assert 1 <= lookups <= LOOKUPS_MAX, lookups
    with _agent_client(io_queues=1) as (agent, clients):
        report = _lookup_latency(clients["nvme-tcp"], agent.unix_url, agent.token, lookups)
        report["rtt_floor_p50_us"] = rtt_floor_us(lookups)  # with the agent up, as run_datapath
    return report


def _ratios(r: dict[str, Any]) -> dict[str, float]:
    def ratio(a: str, b: str) -> float:
        return round(r[a] / r[b], 2) if r.get(a) and r.get(b) else 0.0

    out = {
        "put_vs_redis_set": ratio("put_gbps", "redis_set_gbps"),
        "get_vs_redis_get": ratio("get_gbps", "redis_get_gbps"),
        "put_vs_socket_ceiling": ratio("put_gbps", "socket_ceiling_gbps"),
        "get_vs_socket_ceiling": ratio("get_gbps", "socket_ceiling_gbps"),
    }
    if "nixl_get_gbps" in r:
        out |= {
            "nixl_get_vs_raw": ratio("nixl_get_gbps", "nixl_raw_gbps"),
            "nixl_get_vs_nvme_tcp": ratio("nixl_get_gbps", "get_gbps"),
            "nixl_get_vs_mooncake": ratio("nixl_get_gbps", "mooncake_gbps"),
            "nixl_put_vs_raw": ratio("nixl_put_gbps", "nixl_raw_gbps"),
        }
    if "lmcache_get_gbps" in r:
        out |= {
            "put_vs_lmcache": ratio("put_gbps", "lmcache_put_gbps"),
            "get_vs_lmcache": ratio("get_gbps", "lmcache_get_gbps"),
        }
    return out


def _print_lookup(r: dict[str, Any]) -> None:
    from rich.console import Console

    lookup = (f"p50 {r['lookup_p50_us']} us, p99 {r['lookup_p99_us']} us "
              f"(Unix socket p50 {r['lookup_unix_p50_us']} us)")  # fmt: skip
    Console().print(f"lookup of {r['lookup_keys']} keys: {lookup}; bare echo round trip "
                    f"{r['rtt_floor_p50_us']} us")  # fmt: skip


def _print_ab(r: dict[str, Any]) -> None:
    from rich.console import Console

    c = Console()
    for i, row in enumerate(r["per_round"]):
        c.print(f"round {i}: raw NIXL {row['raw_gbps']} GB/s, agent get {row['get_gbps']} GB/s, "
                f"ratio {row['ratio']} (CPU s/GiB raw {row['raw_cpu_s_per_gib']}, agent get "
                f"{row['get_cpu_s_per_gib']})")  # fmt: skip
    c.print(f"NIXL get vs raw NIXL: median {r['nixl_get_vs_raw']}x (min "
            f"{r['nixl_get_vs_raw_min']}, max {r['nixl_get_vs_raw_max']}) over {r['rounds']} "
            f"rounds of {r['chunks']} x {r['chunk_bytes'] >> 20} MiB")  # fmt: skip
    c.print(
        f"CPU s/GiB of the agent's get: host {r['get_host_cpu_s_per_gib']}, agent "
        f"{r['get_agent_cpu_s_per_gib']} (decrypt + hash threads "
        f"{r['get_agent_io_cpu_s_per_gib']}, lanes {r['get_agent_lane_cpu_s_per_gib']}), NIXL "
        f"worker {r['get_worker_cpu_s_per_gib']}; raw NIXL both sides {r['raw_cpu_s_per_gib']}; "
        f"decrypt + hash alone {r['decrypt_hash_cpu_s_per_gib']}; cores busy: raw "
        f"{r['raw_cores']}, get {r['get_cores']}"
    )


def _pair(r: dict[str, Any], a: str, b: str) -> tuple[str, str]:
    return str(r.get(a, "-")), str(r.get(b, "-"))


def _print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    n = r["streams"]
    table = Table(title=f"data path, {r['chunks']} x {r['chunk_bytes'] >> 20} MiB chunks, "
                        f"{n} streams, UCX_TLS={r['ucx_tls']}")  # fmt: skip
    for col in ("path", "put / SET GB/s", "get / GET GB/s", "host CPU s/GiB", "host copies"):
        table.add_column(col)
    if "put_gbps" in r:
        table.add_row(f"agent, NVMe/TCP ({r['io_queues']} queues) + XTS + checksum",
                      *_pair(r, "put_gbps", "get_gbps"), str(r["host_cpu_s_per_gib"]),
                      str(r["host_copies"]))  # fmt: skip
    if "nixl_put_gbps" in r:
        table.add_row("agent, NIXL (agent WRITEs/READs) + XTS + checksum",
                      *_pair(r, "nixl_put_gbps", "nixl_get_gbps"),
                      str(r["nixl_host_cpu_s_per_gib"]), str(r["nixl_host_copies"]))  # fmt: skip
        table.add_row("raw NIXL WRITE, no tier", "-", str(r.get("nixl_raw_gbps", "-")))
    if "mooncake_gbps" in r:
        table.add_row("Mooncake transfer engine WRITE (TCP)", "-", str(r["mooncake_gbps"]))
    if "lmcache_put_gbps" in r:
        table.add_row(f"LMCache lm:// server, {n} connections",
                      *_pair(r, "lmcache_put_gbps", "lmcache_get_gbps"))  # fmt: skip
    table.add_row(f"redis-server + redis-py/hiredis, {n} connections pipelined",
                  *_pair(r, "redis_set_gbps", "redis_get_gbps"))  # fmt: skip
    table.add_row("same, 1 connection", *_pair(r, "redis_set_1stream_gbps",
                                               "redis_get_1stream_gbps"))  # fmt: skip
    table.add_row(f"socket ceiling ({n} TCP loopback pairs, threads)",
                  *_pair(r, "socket_ceiling_gbps", "socket_ceiling_gbps"))  # fmt: skip
    table.add_row("same, 1 pair", *_pair(r, "socket_ceiling_1stream_gbps",
                                         "socket_ceiling_1stream_gbps"))  # fmt: skip
    table.add_row("1 pair, receiver in another process",
                  *_pair(r, "socket_xproc_gbps", "socket_xproc_gbps"))  # fmt: skip
    Console().print(table)
    for name, why in r.get("skipped", {}).items():
        Console().print(f"{name}: skipped ({why})")
    _print_lookup(r)


@click.command("datapath", help="Put/get GB/s through a real agent (NVMe/TCP, NIXL) vs raw NIXL, "
               "Mooncake, Redis and sockets, all with the same number of streams.")  # fmt: skip
@click.option("--chunks", default=8, type=click.IntRange(1, CHUNKS_MAX), help="32 MiB chunks.")
@click.option("--rounds", default=3, type=click.IntRange(1, ROUNDS_MAX), help="Median of.")
@click.option("--io-queues", default=4, type=click.IntRange(1, 32),
              help="NVMe/TCP I/O queues; Redis and the socket ceiling get as many.")  # fmt: skip
@click.option("--transport", default="all", type=click.Choice(TRANSPORT_CHOICES),
              help="Agent data path(s): all = NVMe/TCP and NIXL (where installed).")  # fmt: skip
@click.option("--lookups", default=2000, type=click.IntRange(1, LOOKUPS_MAX),
              help="64-key lookups timed (each way).")  # fmt: skip
@click.option("--lookup-only", is_flag=True,
              help="Only lookup latencies and the echo floor: no put/get, no Redis.")  # fmt: skip
@click.option(
    "--nixl-ab",
    is_flag=True,
    help="Only NIXL get through the agent against raw NIXL, alternating each round.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report.")
def datapath(
    chunks: int,
    rounds: int,
    io_queues: int,
    transport: str,
    lookups: int,
    lookup_only: bool,
    nixl_ab: bool,
    as_json: bool,
) -> None:
    if nixl_ab:
        r = run_nixl_ab(chunks=chunks, rounds=rounds)
        click.echo(json.dumps(r, indent=1)) if as_json else _print_ab(r)
        return
    if lookup_only:
        r = run_lookup(lookups=lookups)
        click.echo(json.dumps(r, indent=1)) if as_json else _print_lookup(r)
        return
    try:
        r = run_datapath(chunks=chunks, rounds=rounds, io_queues=io_queues, lookups=lookups,
                         transport=transport)  # fmt: skip
    except click.ClickException as e:  # --json callers get JSON, with the same exit code
        if not as_json:
            raise
        click.echo(json.dumps({"error": e.format_message()}))
        raise SystemExit(e.exit_code) from None
    click.echo(json.dumps(r, indent=1)) if as_json else _print_table(r)
