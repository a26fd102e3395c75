"""SPDK's own statistics on /metrics in SPDK mode (a collector: RPCs at scrape time).

`nvmf_get_stats` (per poll group: qpairs, pending bdev I/O, completed NVMe I/O),
`bdev_get_iostat` (per bdev: bytes, operations and latency ticks for read, write, unmap;
latency seconds = ticks / tick_rate, so rate(latency) / rate(ops) is the mean) and
`accel_get_stats` (per opcode and module: executed, failed, bytes: the mlx5 crypto engine
shows here on a BlueField). `kvtier_spdk_up` is 0 when SPDK did not answer the scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from spdk_plugins.rpc import SpdkClient, SpdkError

__all__ = ["SCRAPE_TIMEOUT_S", "SpdkCollector", "spdk_families"]

SCRAPE_TIMEOUT_S = 2.0  # Prometheus' scrape timeout is 10 s by default; stay well inside it
_BDEV_OPS = (("read", "bytes_read"), ("write", "bytes_written"), ("unmap", "bytes_unmapped"))


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _nvmf(stats: dict[str, Any]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    qpairs = GaugeMetricFamily("kvtier_spdk_nvmf_qpairs", "Current qpairs per poll group.",
                               labels=["poll_group", "kind"])  # fmt: skip
    pending = GaugeMetricFamily("kvtier_spdk_nvmf_pending_bdev_io", "Bdev I/O waiting, per "
                                "poll group.", labels=["poll_group"])  # fmt: skip
    done = _counter("kvtier_spdk_nvmf_completed_nvme_io", "NVMe I/O completed per poll group.",
                    ["poll_group"])  # fmt: skip
    for pg in stats.get("poll_groups", []):
        name = str(pg.get("name", "?"))
        qpairs.add_metric([name, "admin"], pg.get("current_admin_qpairs", 0))
        qpairs.add_metric([name, "io"], pg.get("current_io_qpairs", 0))
        pending.add_metric([name], pg.get("pending_bdev_io", 0))
        done.add_metric([name], pg.get("completed_nvme_io", 0))
    yield from (qpairs, pending, done)


def _bdev(stats: dict[str, Any]) -> Iterator[CounterMetricFamily]:
    tick_rate = float(stats.get("tick_rate") or 1)
    nbytes = _counter("kvtier_spdk_bdev_bytes", "Bytes per bdev and op.", ["bdev", "op"])
    ops = _counter("kvtier_spdk_bdev_ops", "Operations per bdev and op.", ["bdev", "op"])
    latency = _counter("kvtier_spdk_bdev_latency_seconds", "Summed latency per bdev and op "
                       "(rate / rate of ops = mean).", ["bdev", "op"])  # fmt: skip
    for b in stats.get("bdevs", []):
        name = str(b.get("name", "?"))
        for op, field in _BDEV_OPS:
            nbytes.add_metric([name, op], b.get(field, 0))
            ops.add_metric([name, op], b.get(f"num_{op}_ops", 0))
            latency.add_metric([name, op], b.get(f"{op}_latency_ticks", 0) / tick_rate)
    yield from (nbytes, ops, latency)


def _accel(stats: dict[str, Any]) -> Iterator[CounterMetricFamily]:
    ops = _counter("kvtier_spdk_accel_ops", "Accel operations by opcode, module and result.",
                   ["opcode", "module", "result"])  # fmt: skip
    nbytes = _counter("kvtier_spdk_accel_bytes", "Accel bytes by opcode and module.",
                      ["opcode", "module"])  # fmt: skip
    for o in stats.get("operations", []):
        key = [str(o.get("opcode", "?")), str(o.get("module_name", "?"))]
        ops.add_metric([*key, "executed"], o.get("executed", 0))
        ops.add_metric([*key, "failed"], o.get("failed", 0))
        nbytes.add_metric(key, o.get("num_bytes", 0))
    yield from (ops, nbytes)


def spdk_families(
    nvmf: dict[str, Any], iostat: dict[str, Any], accel: dict[str, Any]
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The metric families of the three RPC results (pure: tested on recorded replies too)."""
    yield from _nvmf(nvmf)
    yield from _bdev(iostat)
    yield from _accel(accel)


class SpdkCollector(Collector):
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def describe(self) -> list[Any]:
        return []  # not collected at registration (SPDK: an RPC; /proc: no need)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        try:
            with SpdkClient(self.socket_path, timeout_s=SCRAPE_TIMEOUT_S) as c:
                replies = [c.call(m) for m in ("nvmf_get_stats", "bdev_get_iostat",
                                               "accel_get_stats")]  # fmt: skip
        except (SpdkError, OSError):
            yield GaugeMetricFamily("kvtier_spdk_up", "SPDK answered the scrape.", value=0)
            return
        yield GaugeMetricFamily("kvtier_spdk_up", "SPDK answered the scrape.", value=1)
        yield from spdk_families(*replies)
