"""The NIXL data path against real NIXL (UCX over TCP on loopback) in two processes: the agent
child and a host process (tests/nixl_peer.py). Skips where NIXL is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.transport import nixl_status

pytestmark = pytest.mark.skipif(
    not nixl_status()["available"], reason="NIXL not installed: pip install --no-deps nixl-cu12"
)
ROOT = Path(__file__).resolve().parent.parent
# UCX over TCP, as between a host and its DPU without RDMA (not shared memory on one box)
UCX_ENV = {"UCX_TLS": "tcp"}


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var", env={**UCX_ENV, "DPUKV_METRICS_ENABLED": "false",
                                           "DPUKV_STORAGE_DRAM_BYTES": str(512 << 20)})  # fmt: skip
    yield a
    a.stop()


def _peer(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, **UCX_ENV, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "nixl_peer.py"), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _result(proc: subprocess.Popen[str], timeout_s: float = 240) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_nixl_get_and_put_byte_exact_between_processes(agent: AgentProcess) -> None:
    r = _result(_peer("roundtrip", agent.control_url, agent.token))
    assert r["transport"] == "nixl"
    assert (r["stored"], r["loaded"], r["exact"]) == (6, 6, True)
    assert (r["odd_stored"], r["odd_loaded"], r["odd_exact"]) == (3, 3, True)
    assert r["wrong_size_loaded"] == 0
    assert r["batches"] == [[4, 4, True]] * 4


def test_nixl_tenant_cannot_target_buffers_it_did_not_register(agent: AgentProcess) -> None:
    r = _result(_peer("refused", agent.control_url, agent.token, agent.admin_token))
    assert r["get_before_connect"] == "protocol"
    assert r["unregistered"] == "forbidden"
    assert r["past_the_end"] == "forbidden"
    assert r["put_unregistered"] == "forbidden"
    assert r["inside"] == "ok"  # the same call inside the registered region is served
    assert r["other_claims_default_agent"] == "forbidden"
    assert r["other_targets_default_buffer"] == "forbidden"


@pytest.mark.slow
def test_nixl_agent_killed_mid_transfer_is_a_miss_not_garbage(agent: AgentProcess) -> None:
    proc = _peer("killed", agent.control_url, agent.token)
    assert proc.stdout is not None
    seen = []  # NIXL logs to stdout too
    while (line := proc.stdout.readline()) and line.strip() != "TRANSFERRING":
        seen.append(line)
    assert line.strip() == "TRANSFERRING", "".join(seen[-20:])
    agent.kill()
    r = _result(proc)
    assert r["transport"] == "nixl" and r["stored"] == 24
    assert r["loaded"] == 0, r  # nothing counted as loaded: the caller recomputes, never reads junk
    assert r["next_get"] == 0  # the agent is gone: a miss, not an exception


def test_prestart_starts_the_nixl_worker_with_the_agent_and_the_first_host_uses_it(
    tmp_path: Path,
) -> None:
    """[nixl] prestart: the worker is up before any host connects (a host's first connect no
    longer waits for its start inside a call the client gives up on after 5 s), and the first
    host's transfers go through that worker, not a second one."""
    import time

    a = spawn_agent(tmp_path / "var", env={**UCX_ENV, "DPUKV_METRICS_ENABLED": "false",
                                           "DPUKV_NIXL_PRESTART": "true"})  # fmt: skip
    try:
        log = a.data_dir / "agent.log"
        deadline = time.monotonic() + 60
        while '"event": "nixl_started"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        before = log.read_text()
        assert '"event": "nixl_started"' in before, before[-3000:]
        assert '"event": "control_session"' not in before  # no host has asked
        r = _result(_peer("roundtrip", a.control_url, a.token))
        assert r["transport"] == "nixl"
        assert (r["stored"], r["loaded"], r["exact"]) == (6, 6, True)
        assert log.read_text().count('"event": "nixl_started"') == 1
    finally:
        a.stop()
