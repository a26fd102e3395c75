"""The DataPlane protocol: what the agent asks of what moves hosts' bytes (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dpu_agent.control import Session
from dpu_agent.engine import Engine, EngineConfig

__all__ = ["DataPlane"]


class DataPlane(Protocol):
    """Where hosts' NVMe/TCP goes and what backs each tenant's tiers.

    The agent (dpu_agent.service) owns the control plane, the tenants and the engine's life;
    every choice that depends on `[agent] mode` is a method here, so the service has none.
    Embedded (`EmbeddedDataPlane`): the agent's own NVMe/TCP target exports the engine's tiers,
    hosts are allowed per control session and get issued keys. SPDK (`SpdkDataPlane`): SPDK's
    target serves SPDK's namespaces, which the engine reaches through the agent's initiator;
    hosts, keys and the tenants' storage are [spdk]'s.
    """

    offers_nixl: bool  # hello advertises the NIXL data path (it reads the tiers in-process)

    async def open_engine(self, config: EngineConfig) -> Engine:
        """The engine over this plane's tier devices (SPDK: checked and connected first)."""
        ...

    async def start(self) -> None:
        """Open the hosts' data path for the configured tenants (after open_engine)."""
        ...

    async def stop(self) -> None:
        """Close the hosts' data path; the engine is still open."""
        ...

    async def close(self) -> None:
        """After the engine closed: release devices, write issued keys still pending."""
        ...

    def address(self) -> str:
        """`host:port` hosts are pointed at ("" when none)."""
        ...

    def subsystem_nqn(self, tenant: str) -> str:
        """The NVMe subsystem hosts connect to for `tenant`."""
        ...

    def hello_nvme(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        """The hello reply's `nvme` section: address, subsystem, issued keys. `local_host` is
        the agent address the client reached (for a wildcard bind)."""
        ...

    def bind_host(self, session: Session, hostnqn: str) -> None:
        """Allow `hostnqn` on the session's tenant's subsystem while the session lives."""
        ...

    def session_closed(self, session: Session) -> None:
        """What bind_host allowed for the session goes."""
        ...

    def host_add(self, tenant: str, nqn: str) -> dict[str, Any]:
        """`dpuctl hosts add`: allow `nqn` from any address, with issued keys."""
        ...

    def host_list(self, tenant: str) -> dict[str, Any]: ...

    def host_remove(self, tenant: str, nqn: str, end_sessions: Callable[[], int]) -> dict[str, Any]:
        """Revoke the host's keys, end its sessions (`end_sessions`, which returns how many)
        and its connections, take it off the subsystem."""
        ...

    def token_rotated(self, tenant: str) -> dict[str, Any]:
        """The tenant's token changed: revoke what the old one obtained (keys hellos issued);
        what was done (for the reply)."""
        ...

    def flush_keys(self) -> None:
        """Write issued and revoked keys now (blocking: call off the event loop)."""
        ...

    def check_addable(self, tenant: str) -> None:
        """ValueError when a tenant cannot be added while the agent runs."""
        ...

    def add_tenant(self, tenant: str) -> None:
        """Serve `tenant` (the engine has it already)."""
        ...

    def remove_tenant(self, tenant: str) -> dict[str, Any]:
        """Stop serving `tenant` and free what it held; what was freed (for the reply)."""
        ...

    def unconfigured(self, held: set[str], configured: set[str]) -> list[str]:
        """Tenants the engine holds (`held`) that are to be erased at start because the
        configuration no longer names them."""
        ...

    def check_backup(self, op: str) -> None:
        """ValueError when `op` (backup, restore) cannot run on this plane."""
        ...
