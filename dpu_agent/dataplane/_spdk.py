"""SPDK mode: SPDK's nvmf target serves the tenants' namespaces (docs/SPDK.md).

SPDK owns the drive, the DRAM bdevs, the encryption (its crypto vbdev), the subsystems' host
allowlists and keys ([spdk] `hosts`, keyring files). The agent checks SPDK against [spdk] at
start, reaches each tier through its own initiator (dpu_agent.spdk_mode), and points hosts at
SPDK's listener for their tenant's subsystem; it runs no NVMe/TCP target of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from dpu_agent.config import AgentConfig
from dpu_agent.control import Session
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.nvmf import tenant_nqn
from dpu_agent.spdk_mode import SpdkDevices, check_spdk, listener_for
from spdk_plugins import SpdkDesired

__all__ = ["SpdkDataPlane"]

TENANT_EVICT_ALL_BYTES = 1 << 62  # "everything": more than any tier holds
HOSTS_ARE_SPDKS = "SPDK mode: hosts and their keys are [spdk]'s (keyring files)"


class SpdkDataPlane:
    """The DataPlane of `[agent] mode = "spdk"`."""

    offers_nixl = False  # NIXL's agent side reads the tiers in-process; here they are SPDK's

    def __init__(self, cfg: AgentConfig) -> None:
        assert cfg.spdk is not None, "load_config checks SPDK mode has [spdk]"
        self.cfg = cfg
        self.spdk: SpdkDesired = cfg.spdk
        self._engine: Engine | None = None
        self._devices: SpdkDevices | None = None

    # --- lifecycle --------------------------------------------------------------------------
    async def open_engine(self, config: EngineConfig) -> Engine:
        return await asyncio.to_thread(self._open_engine, config)

    def _open_engine(self, config: EngineConfig) -> Engine:
        """Check SPDK against [spdk] (plan, or apply), connect each tier, build the engine."""
        cfg = self.cfg
        keystore = KeyStore(cfg.path(cfg.storage.key_file))  # SPDK's crypto keys come from it
        apply_on_start = cfg.agent.spdk_apply_on_start
        check_spdk(self.spdk, keystore, apply_on_start=apply_on_start, source=cfg.source)
        tiers = [t for t in cfg.spdk_tiers() if t.tenant in cfg.tenants]
        self._devices = SpdkDevices.connect(tiers)
        self._engine = Engine(config, device_factory=self._devices)
        return self._engine

    async def start(self) -> None:
        """SPDK's listeners serve the hosts; the agent opens none."""

    async def stop(self) -> None:
        """Nothing of the hosts' data path is the agent's."""

    async def close(self) -> None:
        self._engine = None
        if self._devices is not None:  # after the engine: its close demotes through them
            self._devices.close()
            self._devices = None

    # --- addresses --------------------------------------------------------------------------
    def address(self) -> str:
        first = next(iter(self.cfg.tenants), "")
        nv = listener_for(self.spdk, first, "")  # SPDK's listener for the hosts
        return f"{nv['host']}:{nv['port']}" if nv else ""

    def subsystem_nqn(self, tenant: str) -> str:
        nv = listener_for(self.spdk, tenant, "")
        return str(nv["subnqn"]) if nv else tenant_nqn(tenant)

    def hello_nvme(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        """SPDK's listener and the tenant's subsystem. The allowlist is [spdk]'s `hosts` (plan
        reconciles it), so hello adds nothing: an unlisted host NQN is refused at connect."""
        nv = listener_for(self.spdk, tenant, local_host)
        assert nv is not None, f"load_config checks tenant {tenant} has an SPDK subsystem"
        return nv

    # --- hosts: [spdk]'s --------------------------------------------------------------------
    def bind_host(self, session: Session, hostnqn: str) -> None:
        """The allowlist is [spdk]'s `hosts`: nothing to bind."""

    def session_closed(self, session: Session) -> None:
        """Nothing was bound."""

    def host_add(self, tenant: str, nqn: str) -> dict[str, Any]:
        raise ValueError(HOSTS_ARE_SPDKS)

    def host_list(self, tenant: str) -> dict[str, Any]:
        raise ValueError(HOSTS_ARE_SPDKS)

    def host_remove(self, tenant: str, nqn: str, end_sessions: Callable[[], int]) -> dict[str, Any]:
        raise ValueError(HOSTS_ARE_SPDKS)

    def token_rotated(self, tenant: str) -> dict[str, Any]:
        """No keys are issued here (SPDK's hosts have the keys [spdk] gives them)."""
        return {}

    def flush_keys(self) -> None:
        """No keys are issued here."""

    # --- tenants: their tiers are SPDK namespaces, connected at start -----------------------
    def check_addable(self, tenant: str) -> None:
        raise ValueError(
            f"SPDK mode: add tenant {tenant!r} to [tenants] and its [[spdk.subsystems]] in "
            f"{self.cfg.source}, then restart the agent"
        )

    def add_tenant(self, tenant: str) -> None:
        self.check_addable(tenant)

    def remove_tenant(self, tenant: str) -> dict[str, Any]:
        """The subsystem and its lvols are [spdk]'s, kept: drop what is unleased."""
        return {"freed_bytes": self.engine.evict(tenant, TENANT_EVICT_ALL_BYTES)}

    def unconfigured(self, held: set[str], configured: set[str]) -> list[str]:
        """None: SPDK's lvols are [spdk]'s (`dpuctl spdk plan` reports what is extra)."""
        return []

    def check_backup(self, op: str) -> None:
        # the agent sees plaintext through SPDK's crypto vbdev: a backup would hold it
        raise ValueError(
            f"{op} is not available in SPDK mode (the agent reads plaintext through "
            "SPDK's crypto vbdev); back up the lvols with SPDK's snapshots instead"
        )

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "open_engine() first"
        return self._engine
