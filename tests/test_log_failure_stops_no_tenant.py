"""The agent's log failing is no reason to stop serving (dpu_agent.log.LossyLineStream).

Found by CI: the disk under the agents' logs filled, and every call that logged a line (a
session's hello, a put, NVMe/TCP's queue connect, the admin `stats`) failed with "[Errno 28] No
space left on device" though the tier's own disk had room; a log reader that is gone (EPIPE) or
stalled (a full pipe: the write blocks) does the same to a deployment. Now what cannot be
written is dropped and counted, the agent serves on, and the log says how many lines it lost
once it works again (`log_lines_dropped`, `kvtier_log_lines_dropped_total`).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.log import LOG_WRITE_WAIT_S, WRITE_CHUNK_BYTES_MAX, LossyLineStream
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("log-test", "float16", num_layers=2, num_kv_heads=2, head_dim=64,
                     chunk_tokens=16)  # fmt: skip
SALT = b"log-failure-salt"
ROUNDS = 3  # fresh clients putting and getting while the log cannot be written
FILL_BYTES_MAX = 8 << 20  # bounds the loop that fills the log's disk


def _notices(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        if '"log_lines_dropped"' in line:
            out.append(json.loads(line))
    return out


# --- the stream itself, on a pipe ---------------------------------------------------------------


@pytest.fixture
def pipe() -> Iterator[tuple[int, int, LossyLineStream]]:
    """(read end, write end, a LossyLineStream on the write end); both ends closed after."""
    r, w = os.pipe()
    try:
        yield r, w, LossyLineStream(w, "<test>")
    finally:
        os.close(r)
        os.close(w)


def test_a_reader_gone_drops_lines_and_never_raises() -> None:
    r, w = os.pipe()
    os.close(r)  # the log collector died
    s = LossyLineStream(w, "<test>")
    try:
        for i in range(5):
            print(f"line {i}", file=s, flush=True)  # EPIPE under the hood: no exception
        assert s.dropped_lines == 5
    finally:
        os.close(w)


def test_a_stalled_reader_costs_one_wait_then_lines_say_how_many_went(
    pipe: tuple[int, int, LossyLineStream],
) -> None:
    r, w, s = pipe
    size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)  # how many bytes fill the pipe
    filler = b"x" * 1023 + b"\n"
    os.set_blocking(w, False)
    with pytest.raises(BlockingIOError):
        for _ in range(size // len(filler) + 2):
            os.write(w, filler)
    os.set_blocking(w, True)  # a blocking descriptor, as a log's is: a plain write hangs
    t0 = time.monotonic()
    for i in range(200):
        s.write(f"while stalled {i}\n")
    took = time.monotonic() - t0
    assert s.dropped_lines == 200
    assert took < 10 * LOG_WRITE_WAIT_S, took  # one wait for the stall, not 200
    # the reader comes back: the next line goes out after a line counting the lost ones
    drained = 0
    while drained < size:
        drained += len(os.read(r, 65536))
    s.write("after\n")
    os.set_blocking(r, False)
    tail = os.read(r, 65536).decode()
    notice = _notices(tail)
    assert [n["lines"] for n in notice] == [200], tail
    assert tail.endswith("after\n")


def test_a_line_cut_midway_is_not_glued_to_the_next(pipe: tuple[int, int, LossyLineStream]) -> None:
    r, w, s = pipe
    size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
    # one line longer than the pipe: its first pieces go out, the rest is dropped
    s.write("a" * (size + 3 * WRITE_CHUNK_BYTES_MAX) + "\n")
    assert s.dropped_lines == 1
    got = b""
    os.set_blocking(r, False)
    while True:
        try:
            chunk = os.read(r, 65536)
        except BlockingIOError:
            break
        got += chunk
    assert got and set(got) == {ord("a")}
    s.write("next\n")
    text = os.read(r, 65536).decode()
    assert text.startswith("\n{"), text  # the cut line ends before the notice
    assert [n["lines"] for n in _notices(text)] == [1]
    assert text.endswith("next\n")


def test_an_unfinished_line_is_held_with_bounded_memory(
    pipe: tuple[int, int, LossyLineStream],
) -> None:
    r, w, s = pipe
    s.write("no newline yet")
    os.set_blocking(r, False)
    with pytest.raises(BlockingIOError):
        os.read(r, 10)  # held until the line ends
    s.write(" ... done\n")
    assert os.read(r, 100) == b"no newline yet ... done\n"
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)  # room for what follows
    s.write("b" * 70_000)  # over PENDING_BYTES_MAX without a newline: written as is
    assert len(os.read(r, 100_000)) == 70_000


# --- a real agent whose log fails ----------------------------------------------------------------


def _serve_rounds(agent: AgentProcess, first: int) -> None:
    """Fresh clients (a hello, NVMe/TCP queues, each logged) put 4 chunks and get them back
    byte-exact; the admin `stats` answers and counts them."""
    for r in range(ROUNDS):
        tokens = list(range(first + r * 1000, first + r * 1000 + 4 * LAYOUT.chunk_tokens))
        chunks = [np.full(LAYOUT.chunk_shape, r * 10 + i, np.float16) for i in range(4)]
        out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(4)]
        with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
            assert c.put(tokens, chunks) == 4
            assert c.get(tokens, out) == 4
        for a, b in zip(chunks, out, strict=True):
            assert np.array_equal(a, b)
        stats = agent.admin("stats")["stats"]
        assert stats["tenants"]["default"]["used_bytes"] > 0


def _dropped_metric(agent: AgentProcess) -> float:
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvtier_log_lines_dropped_total "):
                return float(line.split()[1])
    raise AssertionError("no kvtier_log_lines_dropped_total")


@pytest.fixture
def log_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for the agent's log alone (its data dir has room)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the log's full disk needs root")
    mnt = tmp_path / "logdisk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_under_the_log_stops_no_tenant(tmp_path: Path, log_disk: Path) -> None:
    data = tmp_path / "agent"
    data.mkdir()
    (data / "agent.log").symlink_to(log_disk / "agent.log")  # spawn_agent's log, on the tmpfs
    agent = spawn_agent(data)
    try:
        _serve_rounds(agent, 0)  # the log works
        filler = log_disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            for _ in range(FILL_BYTES_MAX // 4096):
                os.write(fd, b"\0" * 4096)
            pytest.fail("the 1 MiB log disk never filled")
        except OSError:
            pass  # ENOSPC: full, and the log's last page with it
        finally:
            os.close(fd)
        _serve_rounds(agent, 100_000)  # the old agent failed every call here
        assert agent.alive()
        assert _dropped_metric(agent) > 0
        filler.unlink()  # room again: the next line is the count of those lost
        _serve_rounds(agent, 200_000)
        notices = _notices((log_disk / "agent.log").read_text(errors="replace"))
        assert notices and all(int(str(n["lines"])) > 0 for n in notices), notices
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize("reader", ["gone", "stalled"])
def test_a_log_reader_gone_or_stalled_stops_no_tenant(tmp_path: Path, reader: str) -> None:
    data = tmp_path / "agent"
    data.mkdir()
    fifo = data / "agent.log"
    os.mkfifo(fifo)  # spawn_agent appends to it: the agent's stdout and stderr are a pipe
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    agent = spawn_agent(data)
    try:
        if reader == "gone":
            os.close(rfd)  # the log collector died: every write is EPIPE now
            rfd = -1
        else:  # the collector lives but reads nothing: fill the pipe, the agent's writes block
            wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            try:
                with pytest.raises(BlockingIOError):
                    for _ in range(FILL_BYTES_MAX // 4096):
                        os.write(wfd, b"\n" * 4096)
            finally:
                os.close(wfd)
        t0 = time.monotonic()
        _serve_rounds(agent, 0)
        assert agent.alive()
        assert _dropped_metric(agent) > 0
        assert time.monotonic() - t0 < 30  # the old agent hung here for good when stalled
    finally:
        assert agent.stop() == 0
        if rfd >= 0:
            os.close(rfd)
