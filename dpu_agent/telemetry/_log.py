"""Log lines the agent could not write (a collector: read at scrape time).

`kvtier_log_lines_dropped_total`: lines its stdout and stderr dropped (dpu_agent.log's
LossyLineStream: a full disk under the log, a log reader gone or stalled). The agent serves on
through such a failure; this counter, and a `log_lines_dropped` line once the log works again,
say that its log has a hole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dpu_agent.log import dropped_log_lines

__all__ = ["LogCollector"]


class LogCollector(Collector):
    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvtier_log_lines_dropped",
            "Log lines the agent could not write (full disk, log reader gone or stalled).",
            value=dropped_log_lines(),
        )
