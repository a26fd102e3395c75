"""Data-path latency by operation and transport, inside the agent.

`lookup` is the control-plane lookup (transport `control-tcp` or `control-unix`); `get` and
`put` are the NVMe/TCP READ and WRITE commands that move chunk data (transport `nvme-tcp`,
capsule received to completion sent). Other transports (RDMA, NIXL) observe through
`observe(op, transport, seconds)`. Label children are bound once: the data path only calls
`Histogram.observe`.
"""

from __future__ import annotations

from typing import Any

from dpu_agent.metrics import REGISTRY, Histogram

__all__ = ["DATAPATH_SECONDS", "OPS", "TRANSPORTS", "child", "observe"]

OPS = ("lookup", "get", "put")
TRANSPORTS = ("control-tcp", "control-unix", "nvme-tcp", "rdma", "nixl")
# 10 us (a DRAM hit lookup) to 2.5 s (a 32 MiB chunk through a congested link)
_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
              0.1, 0.25, 0.5, 1.0, 2.5)  # fmt: skip

DATAPATH_SECONDS = Histogram(
    "kvtier_datapath_seconds",
    "Data-path latency inside the agent by op (lookup, get, put) and transport.",
    ["op", "transport"],
    buckets=_BUCKETS_S,
    registry=REGISTRY,
)
_children: dict[tuple[str, str], Any] = {
    (op, t): DATAPATH_SECONDS.labels(op, t) for op in OPS for t in TRANSPORTS
}


def child(op: str, transport: str) -> Any:
    """The bound histogram for (op, transport); both from OPS and TRANSPORTS."""
    return _children[(op, transport)]


def observe(op: str, transport: str, seconds: float) -> None:
    _children[(op, transport)].observe(seconds)
