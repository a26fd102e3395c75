"""The agent's NIXL data path (one-sided WRITE/READ into hosts' registered buffers)."""

from dpu_agent.nixl._server import (
    NIXL_IO_WORKERS,
    NIXL_LANES,
    NIXL_SEGMENT_BYTES,
    NIXL_STAGING_SLOTS,
    NixlServer,
    metadata_agent_name,
)

__all__ = [
    "NIXL_IO_WORKERS",
    "NIXL_LANES",
    "NIXL_SEGMENT_BYTES",
    "NIXL_STAGING_SLOTS",
    "NixlServer",
    "metadata_agent_name",
]
