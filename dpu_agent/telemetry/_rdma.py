"""RDMA port counters from sysfs, where the kernel has RDMA devices (a collector).

mlx5 exposes `/sys/class/infiniband/<dev>/ports/<port>/hw_counters/<name>` (out_of_buffer,
out_of_sequence, packet_seq_err, local_ack_timeout_err, rnr_nak_retry_err, rp_cnp_handled,
np_cnp_sent, np_ecn_marked_roce_packets, ...) and `.../counters/<name>` (port_xmit_data,
port_rcv_data, ...). All of them are exported as counters; a machine without RDMA (this CI)
has no such directory and exports nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["SYSFS_INFINIBAND", "WATCHED", "RdmaCollector", "read_port_counters"]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
COUNTER_FILES_MAX = 4096  # devices x ports x counters read per scrape (mlx5: ~80 per port)
WATCHED = ("out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err",
           "rnr_nak_retry_err", "rp_cnp_handled", "np_cnp_sent",
           "np_ecn_marked_roce_packets")  # fmt: skip


def read_port_counters(root: Path = SYSFS_INFINIBAND) -> list[tuple[str, str, str, str, int]]:
    """(device, port, group, counter, value) for every readable counter file."""
    out: list[tuple[str, str, str, str, int]] = []
    files = sorted(root.glob("*/ports/*/*counters/*"))[:COUNTER_FILES_MAX]
    for f in files:
        group = f.parent.name  # hw_counters or counters
        if group not in ("hw_counters", "counters") or not f.is_file():
            continue
        with contextlib.suppress(OSError, ValueError):
            value = int(f.read_text().split()[0])
            out.append((f.parents[3].name, f.parents[1].name, group, f.name, value))
    return out


class RdmaCollector(Collector):
    def __init__(self, root: Path = SYSFS_INFINIBAND) -> None:
        self.root = root

    def describe(self) -> list[Any]:
        return []  # not collected at registration (SPDK: an RPC; /proc: no need)

    def collect(self) -> Iterator[CounterMetricFamily]:
        rows = read_port_counters(self.root)
        if not rows:
            return
        family = CounterMetricFamily(
            "kvtier_rdma_port",
            "RDMA port counters from sysfs (hw_counters: out_of_buffer, np_cnp_sent, "
            "rp_cnp_handled, ...; counters: port_xmit_data, ...).",
            labels=["device", "port", "group", "counter"],
        )
        for device, port, group, name, value in rows:
            family.add_metric([device, port, group, name], value)
        yield family
