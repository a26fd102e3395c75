"""The agent's telemetry beyond its own counters: data-path latency per transport, CPU time
per core and the agent's share (/proc), SPDK's statistics in SPDK mode, RDMA port counters
(sysfs), log lines dropped. `install(cfg)` registers the collectors on the agent's registry for
its lifetime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

from dpu_agent.metrics import REGISTRY
from dpu_agent.telemetry._cpu import CpuCollector, read_proc_self_stat, read_proc_stat
from dpu_agent.telemetry._datapath import DATAPATH_SECONDS, OPS, TRANSPORTS, child, observe
from dpu_agent.telemetry._log import LogCollector
from dpu_agent.telemetry._rdma import WATCHED, RdmaCollector, read_port_counters
from dpu_agent.telemetry._spdk import SpdkCollector, spdk_families

if TYPE_CHECKING:
    from dpu_agent.config import AgentConfig

__all__ = [
    "COLLECTED_METRICS",
    "DATAPATH_SECONDS",
    "OPS",
    "TRANSPORTS",
    "WATCHED",
    "CpuCollector",
    "Installed",
    "LogCollector",
    "RdmaCollector",
    "SpdkCollector",
    "child",
    "install",
    "observe",
    "read_port_counters",
    "read_proc_self_stat",
    "read_proc_stat",
    "spdk_families",
]


# The families the collectors produce (when their source exists: SPDK mode, RDMA devices), for
# dashboard checks; tests/test_telemetry.py checks this against the collectors' output.
COLLECTED_METRICS = frozenset({
    "kvtier_node_cpu_seconds", "kvtier_node_cpus", "kvtier_agent_cpu_seconds",
    "kvtier_rdma_port", "kvtier_spdk_up", "kvtier_spdk_nvmf_qpairs",
    "kvtier_spdk_nvmf_pending_bdev_io", "kvtier_spdk_nvmf_completed_nvme_io",
    "kvtier_spdk_bdev_bytes", "kvtier_spdk_bdev_ops", "kvtier_spdk_bdev_latency_seconds",
    "kvtier_spdk_accel_ops", "kvtier_spdk_accel_bytes", "kvtier_log_lines_dropped",
})  # fmt: skip


@dataclass(slots=True)
class Installed:
    collectors: list[Collector] = field(default_factory=list)

    def close(self) -> None:
        for c in self.collectors:
            REGISTRY.unregister(c)
        self.collectors.clear()


def install(cfg: AgentConfig) -> Installed:
    """CPU, RDMA and log collectors always; SPDK's in SPDK mode (its RPC socket from [spdk])."""
    done = Installed([CpuCollector(), RdmaCollector(), LogCollector()])
    if cfg.spdk_mode and cfg.spdk is not None:
        done.collectors.append(SpdkCollector(cfg.spdk.socket))
    for c in done.collectors:
        REGISTRY.register(c)
    return done
