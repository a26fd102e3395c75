"""RDMA facts NIXL does not give: devices, ports, GID tables, lossless-RoCE state, and GPU
memory registration by dma-buf, through the real pyverbs (rdma-core) and sysfs."""

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
from host_shim.rdma._verbs import (
    DEBIAN_DIST_PACKAGES,
    PortInfo,
    RdmaDevice,
    RdmaUnavailable,
    list_devices,
    load_pyverbs,
    pyverbs_source,
    register_dmabuf,
    roce_gid,
)

__all__ = [
    "DEBIAN_DIST_PACKAGES",
    "GID_ENTRIES_MAX",
    "GidEntry",
    "PortInfo",
    "QosState",
    "RdmaDevice",
    "RdmaRefused",
    "RdmaSelection",
    "RdmaUnavailable",
    "gid_for_address",
    "list_devices",
    "load_pyverbs",
    "parse_pfc",
    "pyverbs_source",
    "read_gid_table",
    "read_qos",
    "register_dmabuf",
    "roce_gid",
    "select_rdma",
]
