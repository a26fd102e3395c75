"""DPU CPU time per core and the agent's own, from /proc (a collector: read at scrape time).

`kvtier_node_cpu_seconds_total{cpu, mode}` from /proc/stat (like node_exporter's
node_cpu_seconds_total: rate() of the non-idle modes is a core's utilisation) and
`kvtier_agent_cpu_seconds_total{mode}` from /proc/self/stat: rate() over the number of cores
(`kvtier_node_cpus`) is the agent's share of the DPU's Arm cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CpuCollector", "read_proc_self_stat", "read_proc_stat"]

PROC = Path("/proc")
_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
CPUS_MAX = 1024  # lines of /proc/stat read; far above any DPU (BF3: 16 Arm cores)


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def read_proc_stat(text: str, hz: int) -> dict[str, dict[str, float]]:
    """cpuN -> mode -> seconds, from /proc/stat's text."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines()[: CPUS_MAX + 1]:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        values = [int(v) for v in fields[1 : 1 + len(_MODES)]]
        out[fields[0][3:]] = {m: v / hz for m, v in zip(_MODES, values, strict=False)}
    return out


def read_proc_self_stat(text: str, hz: int) -> dict[str, float]:
    """user and system seconds of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    rest = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return {"user": int(rest[11]) / hz, "system": int(rest[12]) / hz}


class CpuCollector(Collector):
    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc

    def describe(self) -> list[Any]:
        return []  # not collected at registration (SPDK: an RPC; /proc: no need)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        hz = _ticks()
        try:
            cores = read_proc_stat((self.proc / "stat").read_text(), hz)
            own = read_proc_self_stat((self.proc / "self" / "stat").read_text(), hz)
        except (OSError, ValueError, IndexError):
            return  # no /proc (not Linux): no series rather than a failing scrape
        node = CounterMetricFamily(
            "kvtier_node_cpu_seconds",
            "CPU seconds of each core of this machine (the DPU's Arm cores) by mode.",
            labels=["cpu", "mode"],
        )
        for cpu, modes in cores.items():
            for mode, seconds in modes.items():
                node.add_metric([cpu, mode], seconds)
        yield node
        yield GaugeMetricFamily("kvtier_node_cpus", "Cores of this machine.", value=len(cores))
        agent = CounterMetricFamily(
            "kvtier_agent_cpu_seconds",
            "CPU seconds of the agent process by mode (its share: rate / kvtier_node_cpus).",
            labels=["mode"],
        )
        for mode, seconds in own.items():
            agent.add_metric([mode], seconds)
        yield agent
