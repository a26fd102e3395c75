"""Userspace NVMe/TCP initiator: read KV chunks from a target straight into caller buffers.

Works against the agent's embedded target (`dpu_agent.nvmf`) and SPDK's nvmf target alike.
See docs/NVME_TCP.md.
"""

from host_shim.nvme._auth import DhchapOptions, NvmeAuthError
from host_shim.nvme._blockdev import NvmeTcpBlockDevice
from host_shim.nvme._controller import NvmeTcpController, default_hostnqn, discover
from host_shim.nvme._errors import NvmeError, NvmeStatusError, NvmeTransportError
from host_shim.nvme._queue import C2H_PDU_BYTES_MAX, QueuePairSocket, Request

__all__ = [
    "C2H_PDU_BYTES_MAX",
    "DhchapOptions",
    "NvmeAuthError",
    "NvmeError",
    "NvmeStatusError",
    "NvmeTcpBlockDevice",
    "NvmeTcpController",
    "NvmeTransportError",
    "QueuePairSocket",
    "Request",
    "default_hostnqn",
    "discover",
]
