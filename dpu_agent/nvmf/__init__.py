"""Embedded-mode NVMe/TCP target: exports the agent's block devices to hosts (see docs/NVME_TCP.md).

On a DPU, SPDK's nvmf target does this job; here the agent serves the same subsystems and
namespaces itself, so hosts (the shim's initiator, Linux nvme-tcp, SPDK's initiator) see the
same thing either way.
"""

from dpu_agent.nvmf._connection import ADMIN_ICD_BYTES, MAXH2CDATA, MemoryViewDevice
from dpu_agent.nvmf._controller import Controller
from dpu_agent.nvmf._host_keys import HostKeys, load_host_keys, nqn_hash
from dpu_agent.nvmf._subsystem import (
    DISCOVERY_NQN,
    TENANT_NQN_PREFIX,
    Subsystem,
    TargetOptions,
    tenant_nqn,
)
from dpu_agent.nvmf._target import CONNECTIONS_MAX, NvmeTcpTarget

__all__ = [
    "ADMIN_ICD_BYTES",
    "CONNECTIONS_MAX",
    "DISCOVERY_NQN",
    "MAXH2CDATA",
    "TENANT_NQN_PREFIX",
    "Controller",
    "HostKeys",
    "MemoryViewDevice",
    "NvmeTcpTarget",
    "Subsystem",
    "TargetOptions",
    "load_host_keys",
    "nqn_hash",
    "tenant_nqn",
]
