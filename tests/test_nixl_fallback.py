"""The NIXL path's pure parts (control-op schema, metadata names, region checks, the transport
decision table) and the fallback to NVMe/TCP when NIXL is missing or fails to load."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import nixl_md
import numpy as np
import pytest

from dpu_agent.nixl import metadata_agent_name
from dpu_agent.nixl._server import _Session
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.transport import _lib, buffer_desc, choose_transport
from kvproto.control import (
    NIXL_METADATA_BYTES_MAX,
    NIXL_REGION_BYTES_MAX,
    NIXL_SPAN_BYTES_MAX,
    LocalProtocolError,
    RemoteProtocolError,
    encode_request,
    parse_request,
)
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("nixl-fallback", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"nixl-fallback-salt-0123"
KEY = b"k" * 16


def _md(name: bytes) -> bytes:
    return nixl_md.encode(name)


@pytest.mark.parametrize(
    ("op", "fields", "refused"),
    [
        ("nixl_connect", {"metadata": b""}, "field 'metadata'"),
        ("nixl_connect", {"metadata": b"x" * (NIXL_METADATA_BYTES_MAX + 1)}, "field 'metadata'"),
        ("nixl_register", {"metadata": b"m", "add": [[1, 0, 0, "DRAM"]], "drop": []},
         "field 'add'"),
        ("nixl_register", {"metadata": b"m", "add": [[1, 8, 0, "HBM"]], "drop": []},
         "field 'add'"),
        ("nixl_register", {"metadata": b"m", "add": [[-1, 8, 0, "DRAM"]], "drop": []},
         "field 'add'"),
        ("nixl_register", {"metadata": b"m", "add": [], "drop": [[1, 8, 0, "DRAM", 5]]},
         "field 'drop'"),
        ("nixl_get", {"keys": [KEY], "targets": [[1]]}, "field 'targets'"),
        ("nixl_get", {"keys": [KEY], "targets": [[1, 2, 3]]}, "field 'targets'"),
        ("nixl_get", {"keys": [KEY], "targets": [[True, 2]]}, "field 'targets'"),
        # sizes past what a host can register or a chunk can be, checked before any planning
        ("nixl_register", {"metadata": b"m", "add": [[1, NIXL_REGION_BYTES_MAX + 1, 0, "DRAM"]],
                           "drop": []}, "field 'add'"),
        ("nixl_register", {"metadata": b"m", "add": [[(1 << 64) - 8, 16, 0, "DRAM"]], "drop": []},
         "field 'add'"),
        ("nixl_get", {"keys": [KEY], "targets": [[1, NIXL_SPAN_BYTES_MAX + 1]]},
         "field 'targets'"),
        ("nixl_put", {"keys": [KEY], "sources": [[1, 1 << 46]], "parents": [None]},
         "field 'sources'"),
        ("nixl_put", {"keys": [KEY], "sources": [[(1 << 64) - 8, 16]], "parents": [None]},
         "field 'sources'"),
        ("nixl_put", {"keys": [KEY], "sources": [[1, 2]], "parents": [b"short"]},
         "field 'parents'"),
        ("nixl_put", {"keys": [KEY], "sources": [[1, 2]]}, "missing field 'parents'"),
    ],
)  # fmt: skip
def test_nixl_ops_refuse_malformed_fields(op: str, fields: dict[str, object], refused: str) -> None:
    """Each request is refused for the field it breaks (not for another one by accident)."""
    with pytest.raises(LocalProtocolError, match=f"^{op}: .*{refused}"):
        encode_request(1, op, **fields)


@pytest.mark.parametrize(
    ("op", "fields"),
    [
        ("nixl_connect", {"metadata": _md(b"dpukv.default.1")}),
        ("nixl_connect", {"metadata": b"x" * NIXL_METADATA_BYTES_MAX}),  # the limit itself
        ("nixl_register", {"metadata": b"m", "add": [[1 << 40, 8, 0, "VRAM"]], "drop": []}),
        ("nixl_register", {"metadata": b"m", "add": [[1, NIXL_REGION_BYTES_MAX, 0, "DRAM"]],
                           "drop": [[1 << 40, 8, 0, "VRAM"]]}),
        ("nixl_get", {"keys": [KEY], "targets": [[1 << 40, NIXL_SPAN_BYTES_MAX]]}),
        ("nixl_put", {"keys": [KEY, KEY], "sources": [[1, 2], [3, 4]], "parents": [None, KEY]}),
    ],
)  # fmt: skip
def test_nixl_ops_encode_valid_fields(op: str, fields: dict[str, object]) -> None:
    """Valid requests (limits included) go out, and the server reads back what was sent."""
    frame = encode_request(7, op, **fields)
    req = parse_request(msgpack.unpackb(frame[4:], raw=False))
    assert (req.id, req.op, req.fields) == (7, op, fields)


def test_metadata_agent_name_is_read_before_nixl_loads_it() -> None:
    assert metadata_agent_name(_md(b"dpukv.default.42-ab")) == "dpukv.default.42-ab"
    for bad in (b"", b"garbage", b"nixlSerDes|Agent" + struct.pack("<Q", 1 << 40) + b"x",
                b"nixlSerDes|Agent" + struct.pack("<Q", 0), _md("é".encode())):  # fmt: skip
        with pytest.raises(RemoteProtocolError):
            metadata_agent_name(bad)


def test_session_regions_contain_spans_exactly() -> None:
    s = _Session(sid=1, tenant="t", remote="dpukv.t.1", peer="", metadata=b"")
    s.add(1000, 100, 0, "DRAM")
    s.add(5000, 50, 1, "VRAM")
    assert s.find(1000, 100) == (0, "DRAM")
    assert s.find(1050, 50) == (0, "DRAM")
    assert s.find(1050, 51) is None  # one byte past the end
    assert s.find(999, 2) is None  # starts before the region
    assert s.find(5000, 50) == (1, "VRAM")
    assert s.find(2000, 1) is None  # between regions
    s.drop(1000)
    assert s.find(1000, 1) is None


def test_buffer_desc_regions_of_views_share_their_pool() -> None:
    pool = np.zeros((4, 1024), np.float16)
    a, b = buffer_desc(pool[1], 2048, writable=True), buffer_desc(pool[3], 2048, writable=True)
    assert a.region == b.region == (int(pool.ctypes.data), pool.nbytes, 0, "DRAM")
    assert b.addr - a.addr == 2 * 2048
    with pytest.raises(ValueError, match="read-only"):
        buffer_desc(bytes(2048), 2048, writable=True)
    with pytest.raises(ValueError, match="bytes"):
        buffer_desc(bytearray(100), 2048, writable=True)


HOST_OK = {"available": True, "module": "nixl_cu12", "reason": ""}
HOST_NO = {"available": False, "module": "", "reason": "not installed"}


@pytest.mark.parametrize(
    ("wanted", "host", "agent", "expected"),
    [
        ("nvme-tcp", HOST_OK, {"available": True}, "nvme-tcp"),
        ("auto", HOST_OK, {"available": True}, "nixl"),
        ("nixl", HOST_OK, {"available": True}, "nixl"),
        ("auto", HOST_NO, {"available": True}, "nvme-tcp"),
        ("auto", HOST_OK, None, "nvme-tcp"),  # an agent from before NIXL
        ("nixl", HOST_OK, {"available": False, "reason": "x"}, "nvme-tcp"),
    ],
)
def test_choose_transport_table(
    wanted: str, host: dict[str, object], agent: dict[str, object] | None, expected: str
) -> None:
    transport, why = choose_transport(wanted, host, agent)
    assert transport == expected and why


def test_unknown_transport_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="nixl, nvme-tcp, auto"):
        KVClient("tcp://127.0.0.1:1", "default", "t", LAYOUT, SALT, transport="rdma")


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var", env={"DPUKV_METRICS_ENABLED": "false"})
    yield a
    a.stop()


@pytest.fixture()
def broken_nixl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """NIXL that fails to load: one module missing, one raising at import (a lost libucx)."""
    (tmp_path / "broken_nixl_for_test.py").write_text(
        "raise OSError('libucp.so.0: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_lib, "NIXL_MODULES", ("missing_nixl_for_test", "broken_nixl_for_test"))
    _lib._forget_for_tests()
    yield
    _lib._forget_for_tests()


@pytest.mark.parametrize("wanted", ["auto", "nixl"])
def test_nixl_missing_falls_back_to_nvme_tcp_with_a_log(
    agent: AgentProcess, broken_nixl: None, wanted: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="host_shim.transport")
    chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(3)]
    out = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(3)]
    tokens = list(range(3 * LAYOUT.chunk_tokens))
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT, transport=wanted) as c:
        assert c.put(tokens, chunks) == 3
        assert c.get(tokens, out) == 3
        assert c.transport == "nvme-tcp"
    assert all(np.array_equal(a, b) for a, b in zip(chunks, out, strict=True))
    msgs = [r for r in caplog.records if "data path nvme-tcp" in r.getMessage()]
    assert len(msgs) == 1, [r.getMessage() for r in caplog.records]
    assert "libucp.so.0" in msgs[0].getMessage() and "nixl-cu12" in msgs[0].getMessage()
    assert msgs[0].levelno == (logging.WARNING if wanted == "nixl" else logging.INFO)


@pytest.mark.skipif(not _lib.nixl_status()["available"], reason="NIXL not installed")
def test_nixl_failing_on_a_live_agent_falls_back_to_nvme_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from host_shim.client import ControlError
    from host_shim.transport import NixlDataPath

    monkeypatch.setenv("UCX_TLS", "tcp")
    a = spawn_agent(tmp_path / "var", env={"DPUKV_METRICS_ENABLED": "false", "UCX_TLS": "tcp"})
    caplog.set_level(logging.INFO, logger="host_shim.transport")
    chunks = [np.full(LAYOUT.chunk_shape, i + 1, np.float16) for i in range(2)]
    out = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
    tokens = list(range(2 * LAYOUT.chunk_tokens))
    try:
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT, transport="nixl") as c:
            assert c.put(tokens, chunks) == 2 and c.transport == "nixl"

            def broken(*args: object, **kwargs: object) -> int:
                raise ControlError("failed", "NIXL transfer failed: injected")

            monkeypatch.setattr(NixlDataPath, "get", broken)
            assert c.get(tokens, out) == 2  # served over NVMe/TCP instead
            assert c.transport == "nvme-tcp"
    finally:
        a.stop()
    assert all(np.array_equal(x, y) for x, y in zip(chunks, out, strict=True))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("data path nvme-tcp" in r.getMessage() and "injected" in r.getMessage()
               for r in warned), [r.getMessage() for r in caplog.records]  # fmt: skip


def test_nixl_log_lines_stay_off_stdout() -> None:
    """The failure: NIXL's import puts a handler on stdout at INFO, so `dpuctl bench datapath
    --json` printed "NIXL INFO ... Backend UCX was instantiated" before the JSON report."""
    from host_shim.transport import nixl_status

    if not nixl_status()["available"]:
        pytest.skip(f"NIXL not installed here: {nixl_status()['reason']}")
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from host_shim.transport._lib import load_nixl\n"
        "load_nixl()\n"
        "logging.getLogger('nixl.api').info('line-from-nixl')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "line-from-nixl" not in done.stdout
    assert "line-from-nixl" in done.stderr
