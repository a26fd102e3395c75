"""`dpuctl bench datapath`: end-to-end put/get GB/s through a real agent, next to Redis and the
ceiling of a plain socket, plus control-plane lookup latency.

In one run on one machine (figures move 2-3x between runs, ../shared/MEASURED.md):

- agent: a `dpuctl agent run` child on loopback ports; KVClient puts and gets 32 MiB chunks
  (a Llama-3-8B-shaped layout: 32 layers x K/V x 8 KV heads x 256 tokens x 128 dims, fp16)
  through the control plane, NVMe/TCP with several I/O queues, AES-XTS and checksums;
- redis: a `redis-server` child (no persistence, loopback) with redis-py + hiredis doing SET and
  GET of the same bytes;
- socket ceiling: a TCP loopback pair, `sendall` into `recv_into` a preallocated buffer in
  another thread (`socket_xproc_gbps`: the receiver in another process, for context);
- lookup: p50/p99 of 64-key lookups (control-plane round trip over TCP, keys precomputed; the
  p50 over the Unix socket too), next to the round trip to a bare asyncio echo server in
  another process (`rtt_floor_p50_us`).

Agent, Redis and the socket take turns within each round (so the machine's load hits all three
alike); one unmeasured warm-up round; GB/s is the median of the measured rounds.

`--lookup-only` measures only the lookup latencies and the echo floor (no put/get rounds, no
Redis): `dpuctl bench datapath --lookup-only --json`, a few seconds, for control-plane work.

GB/s = 10^9 bytes/s. Every get is checked byte-exact against what was put.
"""

from __future__ import annotations

import contextlib
import json
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

from dpu_agent.service import spawn_agent
from host_shim.client import ControlChannel, KVClient
from kvproto.keys import ChunkLayout

__all__ = [
    "datapath",
    "redis_server",
    "run_datapath",
    "run_lookup",
    "socket_ceiling",
    "socket_xproc",
]

LAYOUT = ChunkLayout("bench-llama3-8b", "float16", 32, 8, 128, chunk_tokens=256)  # 32 MiB
ROUNDS_MAX = 10  # each round moves chunks x 32 MiB both ways; bounded run time
CHUNKS_MAX = 16  # 512 MiB per round: client memory and the agent's DRAM tier bound it
LOOKUPS_MAX = 20000
REDIS_START_TIMEOUT_S = 10.0


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
    ../shared/MEASURED.md measures it: the stricter figure, no process switch in the way)."""
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


def _agent_round(
    client: KVClient, chunks: list[np.ndarray], out: list[np.ndarray], rnd: int
) -> tuple[float, float]:
    """Seconds for put then get of every chunk (a new prompt each round), byte-exact."""
    n = len(chunks)
    tokens = np.arange(n * LAYOUT.chunk_tokens, dtype=np.uint32) + (rnd + 1) * 1_000_003
    t0 = time.perf_counter()
    stored = client.put(tokens, chunks)
    t1 = time.perf_counter()
    assert stored == n, f"put stored {stored} of {n} chunks"
    loaded = client.get(tokens, out)
    t2 = time.perf_counter()
    assert loaded == n, f"get loaded {loaded} of {n} chunks"
    for a, b in zip(chunks, out, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "get is not byte-exact"
    client.delete(tokens)
    return t1 - t0, t2 - t1


def _interleaved(client: KVClient, r: Any, data: list[np.ndarray], rounds: int) -> dict[str, Any]:
    """Agent, Redis and the socket ceiling take turns each round, so load on the machine hits
    all three alike; round -1 warms up (first touch of the tiers, buffers) and is dropped."""
    nbytes = sum(c.nbytes for c in data)
    out = [np.empty_like(c) for c in data]
    times: dict[str, list[float]] = {"put": [], "get": [], "set": [], "rget": []}
    ceilings, xprocs = [], []
    for rnd in range(-1, rounds):
        put_s, get_s = _agent_round(client, data, out, rnd)
        set_s, rget_s = _redis_round(r, data, rnd)
        ceiling, xproc = socket_ceiling(nbytes), socket_xproc(nbytes)
        if rnd >= 0:
            for k, v in zip(times, (put_s, get_s, set_s, rget_s), strict=True):
                times[k].append(v)
            ceilings.append(ceiling)
            xprocs.append(xproc)
    return {
        "put_gbps": _gbps(nbytes, statistics.median(times["put"])),
        "get_gbps": _gbps(nbytes, statistics.median(times["get"])),
        "redis_set_gbps": _gbps(nbytes, statistics.median(times["set"])),
        "redis_get_gbps": _gbps(nbytes, statistics.median(times["rget"])),
        "socket_ceiling_gbps": statistics.median(ceilings),
        "socket_xproc_gbps": statistics.median(xprocs),
    }


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


def _lookup_latency(client: KVClient, unix_url: str, token: str, count: int) -> dict[str, Any]:
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


@contextlib.contextmanager
def _agent_client(io_queues: int) -> Iterator[tuple[Any, KVClient]]:
    """A fresh agent child (DRAM tier sized for the largest run, metrics off) and a client."""
    with tempfile.TemporaryDirectory(prefix="dpukv-bench-") as tmp:
        env = {"DPUKV_STORAGE_DRAM_BYTES": str(2 * CHUNKS_MAX * LAYOUT.chunk_bytes),
               "DPUKV_METRICS_ENABLED": "false"}  # fmt: skip
        agent = spawn_agent(Path(tmp) / "var", env=env)
        try:
            salt = b"bench-salt-0123456789"
            with KVClient(agent.control_url, "default", agent.token, LAYOUT, salt,
                          io_queues=io_queues) as client:  # fmt: skip
                yield agent, client
        finally:
            agent.stop()


def run_datapath(
    *, chunks: int = 8, rounds: int = 3, io_queues: int = 4, lookups: int = 2000
) -> dict[str, Any]:
    assert 1 <= chunks <= CHUNKS_MAX and 1 <= rounds <= ROUNDS_MAX, (chunks, rounds)
    assert 1 <= lookups <= LOOKUPS_MAX, lookups
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
            for _ in range(chunks)]  # fmt: skip
    report: dict[str, Any] = {"chunk_bytes": LAYOUT.chunk_bytes, "chunks": chunks,
                              "rounds": rounds, "io_queues": io_queues}  # fmt: skip
    with _agent_client(io_queues) as (agent, client), redis_server() as r:
        report |= _interleaved(client, r, data, rounds)
        report |= _lookup_latency(client, agent.unix_url, agent.token, lookups)
        report["rtt_floor_p50_us"] = rtt_floor_us(lookups)
    return report | _ratios(report)


def run_lookup(*, lookups: int = 2000) -> dict[str, Any]:
    """Only the lookup figures of run_datapath (same agent, keys and hits) and the echo floor."""
    assert 1 <= lookups <= LOOKUPS_MAX, lookups
    with _agent_client(io_queues=1) as (agent, client):
        report = _lookup_latency(client, agent.unix_url, agent.token, lookups)
        report["rtt_floor_p50_us"] = rtt_floor_us(lookups)  # with the agent up, as run_datapath
    return report


def _ratios(r: dict[str, Any]) -> dict[str, float]:
    def ratio(a: str, b: str) -> float:
        return round(r[a] / r[b], 2) if r.get(b) else 0.0

    return {
        "put_vs_redis_set": ratio("put_gbps", "redis_set_gbps"),
        "get_vs_redis_get": ratio("get_gbps", "redis_get_gbps"),
        "put_vs_socket_ceiling": ratio("put_gbps", "socket_ceiling_gbps"),
        "get_vs_socket_ceiling": ratio("get_gbps", "socket_ceiling_gbps"),
    }


def _print_lookup(r: dict[str, Any]) -> None:
    from rich.console import Console

    lookup = (f"p50 {r['lookup_p50_us']} us, p99 {r['lookup_p99_us']} us "
              f"(Unix socket p50 {r['lookup_unix_p50_us']} us)")  # fmt: skip
    Console().print(f"lookup of {r['lookup_keys']} keys: {lookup}; bare echo round trip "
                    f"{r['rtt_floor_p50_us']} us")  # fmt: skip


def _print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"data path, {r['chunks']} x {r['chunk_bytes'] >> 20} MiB chunks")
    table.add_column("path")
    table.add_column("put / SET GB/s")
    table.add_column("get / GET GB/s")
    table.add_row("agent (control + NVMe/TCP + XTS + checksum)", str(r["put_gbps"]),
                  str(r["get_gbps"]))  # fmt: skip
    table.add_row("redis-server + redis-py/hiredis", str(r["redis_set_gbps"]),
                  str(r["redis_get_gbps"]))  # fmt: skip
    table.add_row("socket ceiling (TCP loopback, threads)", str(r["socket_ceiling_gbps"]),
                  str(r["socket_ceiling_gbps"]))  # fmt: skip
    table.add_row("same, receiver in another process", str(r["socket_xproc_gbps"]),
                  str(r["socket_xproc_gbps"]))  # fmt: skip
    Console().print(table)
    _print_lookup(r)


@click.command("datapath", help="Put/get GB/s through a real agent vs Redis and a socket.")
@click.option("--chunks", default=8, type=click.IntRange(1, CHUNKS_MAX), help="32 MiB chunks.")
@click.option("--rounds", default=3, type=click.IntRange(1, ROUNDS_MAX), help="Median of.")
@click.option("--io-queues", default=4, type=click.IntRange(1, 32))
@click.option("--lookups", default=2000, type=click.IntRange(1, LOOKUPS_MAX),
              help="64-key lookups timed (each way).")  # fmt: skip
@click.option("--lookup-only", is_flag=True,
              help="Only lookup latencies and the echo floor: no put/get, no Redis.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report.")
def datapath(
    chunks: int, rounds: int, io_queues: int, lookups: int, lookup_only: bool, as_json: bool
) -> None:
    if lookup_only:
        r = run_lookup(lookups=lookups)
        click.echo(json.dumps(r, indent=1)) if as_json else _print_lookup(r)
        return
    r = run_datapath(chunks=chunks, rounds=rounds, io_queues=io_queues, lookups=lookups)
    click.echo(json.dumps(r, indent=1)) if as_json else _print_table(r)
