"""The agent's data plane: the one place that looks at `[agent] mode` (docs/ARCHITECTURE.md).

The service drives either plane the same way:

    plane = data_plane(cfg)  # EmbeddedDataPlane or SpdkDataPlane
    engine = await plane.open_engine(engine_config)
    await plane.start()  # the hosts' data path is open
    ...
    await plane.stop()  # then the engine closes
    await plane.close()
"""

from __future__ import annotations

from dpu_agent.config import AgentConfig
from dpu_agent.dataplane._base import DataPlane
from dpu_agent.dataplane._embedded import HOSTS_PER_TENANT_MAX, EmbeddedDataPlane
from dpu_agent.dataplane._spdk import SpdkDataPlane
from dpu_agent.nvmf import CONNECTIONS_MAX as EMBEDDED_CONNECTIONS_MAX

__all__ = [
    "HOSTS_PER_TENANT_MAX",
    "DataPlane",
    "EmbeddedDataPlane",
    "SpdkDataPlane",
    "data_path_fds_max",
    "data_plane",
]


def data_plane(cfg: AgentConfig) -> DataPlane:
    """The data plane `[agent] mode` names (load_config checked the mode and its sections)."""
    if cfg.spdk_mode:
        return SpdkDataPlane(cfg)
    return EmbeddedDataPlane(cfg)


def data_path_fds_max(cfg: AgentConfig) -> int:
    """Descriptors the hosts' data path may hold in the agent's process: the embedded NVMe/TCP
    target's connections; none in SPDK mode (SPDK's process holds them)."""
    return 0 if cfg.spdk_mode else EMBEDDED_CONNECTIONS_MAX
