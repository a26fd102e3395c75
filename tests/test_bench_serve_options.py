"""`dpuctl bench serve` without vLLM: option bounds, percentiles, and the streaming client's
parsing of an OpenAI-style SSE stream (a loopback HTTP server speaking the wire format; the
real servers are in tests/test_engine_serve.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

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
