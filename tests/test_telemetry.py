"""Telemetry: /proc and sysfs parsers on recorded inputs, SPDK's statistics from recorded and
live replies, and /metrics scraped from a real agent after a lookup, put and get."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpu_agent import telemetry
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

DATA = Path(__file__).parent / "data" / "telemetry"
LAYOUT = ChunkLayout("telemetry-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"telemetry-test-salt"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _families(collector: object) -> dict[str, list]:
    return {f.name: f.samples for f in collector.collect()}  # type: ignore[attr-defined]


def test_proc_stat_per_core_seconds_from_a_16_core_record() -> None:
    cores = telemetry.read_proc_stat((DATA / "proc_stat_bf3.txt").read_text(), hz=100)
    assert sorted(cores, key=int) == [str(i) for i in range(16)]
    assert cores["3"]["user"] == 10.03 and cores["3"]["idle"] == 799.97
    assert cores["0"]["softirq"] == 0.3 and "cpu" not in cores  # the total line is skipped


def test_proc_self_stat_with_spaces_in_the_command_name() -> None:
    line = "4242 (dpuctl agent) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1 2 3"
    assert telemetry.read_proc_self_stat(line, hz=100) == {"user": 2.5, "system": 0.75}


def test_cpu_collector_reads_this_machine() -> None:
    fams = _families(telemetry.CpuCollector())
    cpus = {s.labels["cpu"] for s in fams["kvtier_node_cpu_seconds"]}
    assert len(cpus) == os.cpu_count() and fams["kvtier_node_cpus"][0].value == len(cpus)
    agent = {s.labels["mode"]: s.value for s in fams["kvtier_agent_cpu_seconds"]}
    assert agent["user"] + agent["system"] > 0  # this test process has used CPU


def test_rdma_counters_in_the_mlx5_sysfs_layout(tmp_path: Path) -> None:
    hw = tmp_path / "mlx5_0" / "ports" / "1" / "hw_counters"
    hw.mkdir(parents=True)
    for name, value in (("out_of_buffer", 7), ("np_cnp_sent", 1234), ("rp_cnp_handled", 99)):
        (hw / name).write_text(f"{value}\n")
    (tmp_path / "mlx5_0" / "ports" / "1" / "counters").mkdir()
    (tmp_path / "mlx5_0" / "ports" / "1" / "counters" / "port_xmit_data").write_text("5000\n")
    rows = telemetry.read_port_counters(tmp_path)
    assert ("mlx5_0", "1", "hw_counters", "np_cnp_sent", 1234) in rows
    assert ("mlx5_0", "1", "counters", "port_xmit_data", 5000) in rows
    samples = _families(telemetry.RdmaCollector(tmp_path))["kvtier_rdma_port"]
    assert {s.labels["counter"] for s in samples} >= {"out_of_buffer", "rp_cnp_handled"}
    assert _families(telemetry.RdmaCollector(tmp_path / "absent")) == {}


def test_spdk_families_from_recorded_replies() -> None:
    replies = [json.loads((DATA / f"spdk_{m}.json").read_text())
               for m in ("nvmf_get_stats", "bdev_get_iostat", "accel_get_stats")]  # fmt: skip
    fams = {f.name: f.samples for f in telemetry.spdk_families(*replies)}
    qp = {(s.labels["poll_group"], s.labels["kind"]) for s in fams["kvtier_spdk_nvmf_qpairs"]}
    assert ("nvmf_tgt_poll_group_000", "io") in qp
    reads = next(s for s in fams["kvtier_spdk_bdev_bytes"]
                 if s.labels == {"bdev": "M0", "op": "read"})  # fmt: skip
    assert reads.value == replies[1]["bdevs"][0]["bytes_read"]
    lat = next(s for s in fams["kvtier_spdk_bdev_latency_seconds"] if s.labels["op"] == "read")
    assert lat.value == pytest.approx(
        replies[1]["bdevs"][0]["read_latency_ticks"] / replies[1]["tick_rate"]
    )
    ops = {(s.labels["opcode"], s.labels["result"]): s.value for s in fams["kvtier_spdk_accel_ops"]}
    assert ops[("copy", "executed")] == replies[2]["operations"][0]["executed"]


def test_spdk_collector_without_spdk_says_down(tmp_path: Path) -> None:
    fams = _families(telemetry.SpdkCollector(str(tmp_path / "no.sock")))
    assert fams == {"kvtier_spdk_up": [fams["kvtier_spdk_up"][0]]}
    assert fams["kvtier_spdk_up"][0].value == 0


def _spdk_tgt() -> str | None:
    if os.environ.get("SPDK_TGT"):
        return os.environ["SPDK_TGT"]
    return None


@pytest.mark.skipif(_spdk_tgt() is None, reason="SPDK_TGT not set (see README)")
def test_spdk_collector_against_a_real_spdk_tgt(tmp_path: Path) -> None:
    from spdk_plugins.rpc import SpdkClient

    sock = str(tmp_path / "spdk.sock")
    with open(tmp_path / "spdk.log", "w") as log:
        proc = subprocess.Popen([str(_spdk_tgt()), "-r", sock, "--no-huge", "-s", "1024",
                                 "-m", "0x1"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not Path(sock).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with SpdkClient(sock, timeout_s=30) as c:
            c.call("framework_wait_init")
            c.call("bdev_malloc_create", {"num_blocks": 256, "block_size": 4096, "name": "M0"})
            c.call("nvmf_create_transport", {"trtype": "TCP"})
        fams = _families(telemetry.SpdkCollector(sock))
        assert fams["kvtier_spdk_up"][0].value == 1
        assert any(s.labels.get("bdev") == "M0" for s in fams["kvtier_spdk_bdev_ops"])
        assert fams["kvtier_spdk_nvmf_qpairs"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("telemetry") / "var")
    yield a
    a.stop()


def _scrape(agent: AgentProcess) -> str:
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        return r.read().decode()


def test_metrics_of_a_real_agent_after_lookup_put_get(agent: AgentProcess) -> None:
    tokens = list(range(3 * LAYOUT.chunk_tokens))
    chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(3)]
    out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(3)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, chunks) == 3
        assert c.lookup(tokens) == 3
        assert c.get(tokens, out) == 3
    s = _samples(_scrape(agent))

    def count(op: str, transport: str) -> float:
        key = ("kvtier_datapath_seconds_count", (("op", op), ("transport", transport)))
        return s.get(key, 0.0)

    assert count("lookup", "control-tcp") >= 1
    assert count("put", "nvme-tcp") >= 3 and count("get", "nvme-tcp") >= 3
    assert count("lookup", "control-unix") == 0
    with KVClient(agent.unix_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.lookup(tokens) == 3
    s = _samples(_scrape(agent))
    assert count("lookup", "control-unix") >= 1
    cpus = {dict(k[1])["cpu"] for k in s if k[0] == "kvtier_node_cpu_seconds_total"}
    assert len(cpus) == os.cpu_count()
    assert s[("kvtier_agent_cpu_seconds_total", (("mode", "user"),))] > 0
    assert ("kvtier_spdk_up", ()) not in s  # embedded mode: no SPDK collector
    if shutil.which("ibv_devices") is None and not Path("/sys/class/infiniband").exists():
        assert not any(k[0].startswith("kvtier_rdma_port") for k in s)  # no RDMA here


def test_collected_metrics_list_is_what_the_collectors_produce(tmp_path: Path) -> None:
    (tmp_path / "mlx5_0/ports/1/hw_counters").mkdir(parents=True)
    (tmp_path / "mlx5_0/ports/1/hw_counters/np_cnp_sent").write_text("1\n")
    replies = [json.loads((DATA / f"spdk_{m}.json").read_text())
               for m in ("nvmf_get_stats", "bdev_get_iostat", "accel_get_stats")]  # fmt: skip
    names = (
        set(_families(telemetry.CpuCollector()))
        | set(_families(telemetry.RdmaCollector(tmp_path)))
        | set(_families(telemetry.LogCollector()))
        | {f.name for f in telemetry.spdk_families(*replies)}
    )
    names |= set(_families(telemetry.SpdkCollector(str(tmp_path / "no.sock"))))  # spdk_up
    assert names == telemetry.COLLECTED_METRICS


def test_dashboard_charts_datapath_cpu_spdk_and_rdma() -> None:
    doc = json.loads((Path(__file__).parent.parent / "docs/grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in doc["panels"] for t in p.get("targets", []))
    for name in ("kvtier_datapath_seconds_bucket", "kvtier_node_cpu_seconds_total",
                 "kvtier_agent_cpu_seconds_total", "kvtier_spdk_bdev_ops_total",
                 "kvtier_spdk_nvmf_completed_nvme_io_total", "kvtier_spdk_accel_ops_total",
                 "kvtier_rdma_port_total"):  # fmt: skip
        assert name in exprs, name
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
