"""RDMA facts NIXL does not give: devices, ports, GID tables and lossless-RoCE state, read from
sysfs, and the port UCX may use (`select_rdma`)."""

from host_shim.rdma._select import RdmaRefused, RdmaSelection, select_rdma
from host_shim.rdma._sysfs import (
    GID_ENTRIES_MAX,
    GidEntry,
    QosState,
    gid_for_address,
    parse_pfc,
    read_gid_table,
    read_qos,
)

__all__ = [
    "GID_ENTRIES_MAX",
    "GidEntry",
    "QosState",
    "RdmaRefused",
    "RdmaSelection",
    "gid_for_address",
    "parse_pfc",
    "read_gid_table",
    "read_qos",
    "select_rdma",
]
