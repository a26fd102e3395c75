"""The shim's transports besides its own NVMe/TCP initiator: NIXL (UCX: RDMA verbs with
GPUDirect on hardware, TCP or shared memory elsewhere), and the choice between them."""

from host_shim.transport._lib import (
    NIXL_MODULES,
    PROGRESS_DELAY_US,
    NixlUnavailable,
    load_nixl,
    new_agent,
    nixl_status,
)
from host_shim.transport._nixl import (
    NIXL_REGIONS_MAX,
    NIXL_REGISTERED_BYTES_MAX,
    BufferDesc,
    NixlHostPath,
    buffer_desc,
)
from host_shim.transport._path import (
    TRANSPORTS,
    NixlDataPath,
    Transport,
    TransportSelector,
    choose_transport,
)

__all__ = [
    "NIXL_MODULES",
    "NIXL_REGIONS_MAX",
    "NIXL_REGISTERED_BYTES_MAX",
    "PROGRESS_DELAY_US",
    "TRANSPORTS",
    "BufferDesc",
    "NixlDataPath",
    "NixlHostPath",
    "NixlUnavailable",
    "Transport",
    "TransportSelector",
    "buffer_desc",
    "choose_transport",
    "load_nixl",
    "new_agent",
    "nixl_status",
]
