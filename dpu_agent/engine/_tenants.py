"""The tenants: each one's state (tiers, quota, counters) by name and by id, and the device
factory that builds their tiers. Called with the engine lock held."""

from __future__ import annotations

from collections.abc import Iterator

from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice
from dpu_agent.engine.errors import UnknownTenant
from dpu_agent.engine.tiers import DRAM, NVME, DeviceFactory, Tier, TierSpec
from dpu_agent.engine.types import EngineConfig, TenantState

__all__ = ["Tenants"]


class Tenants:
    """Owns the name -> TenantState and id -> TenantState maps and the device factory. Reads
    like a mapping of names (`tenants["acme"]`, `.values()`, `in`, `len`)."""

    def __init__(self, config: EngineConfig, factory: DeviceFactory) -> None:
        self._config = config
        self.factory = factory
        self._by_name: dict[str, TenantState] = {}
        self._by_id: dict[int, TenantState] = {}

    def __getitem__(self, name: str) -> TenantState:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def values(self) -> list[TenantState]:
        return list(self._by_name.values())

    def items(self) -> list[tuple[str, TenantState]]:
        return list(self._by_name.items())

    def get(self, name: str) -> TenantState:
        """The tenant, or UnknownTenant naming how to add it."""
        ts = self._by_name.get(name)
        if ts is None:
            raise UnknownTenant(
                f"tenant {name!r} is not configured on this agent; add it under "
                f"[tenants.{name}] in the config (or Engine.add_tenant)"
            )
        return ts

    def find(self, name: str) -> TenantState | None:
        return self._by_name.get(name)

    def by_id(self, tenant_id: int) -> TenantState:
        return self._by_id[tenant_id]

    def find_id(self, tenant_id: int) -> TenantState | None:
        return self._by_id.get(tenant_id)

    def by_ids(self) -> list[TenantState]:
        """Every tenant in id order."""
        return [self._by_id[tid] for tid in sorted(self._by_id)]

    def names_by_id(self) -> dict[int, str]:
        return {tid: ts.name for tid, ts in self._by_id.items()}

    def free_ids(self, count: int) -> list[int]:
        """The `count` smallest tenant ids not in use (ids are journaled: they name a tenant
        on disk)."""
        used = self._by_id
        return [tid for tid in range(1, len(used) + count + 1) if tid not in used][:count]

    def prepare(self, names: list[str]) -> None:
        """Before new tenants are built: what the device factory does for many at once (the
        embedded one: their keys in one write), where it can."""
        prepare = getattr(self.factory, "prepare", None)
        if prepare is not None:
            prepare(names)

    def nvme_devices(self) -> list[BlockDevice]:
        return [ts.tiers[NVME].device for ts in self._by_name.values()]

    def require_key(self, name: str, generation: int) -> None:
        """The tenant's NVMe chunks were written under `generation`: its key must exist (a
        factory without keys of its own has nothing to check)."""
        check = getattr(self.factory, "require_key", None)
        if check is not None:
            check(name, generation)

    def build(
        self, name: str, tid: int, quota_bytes: int, nvme_generation: int | None = None
    ) -> TenantState:
        """Build the tenant's tiers through the device factory and register it."""
        tiers = []
        sizes = {DRAM: self._config.dram_bytes, NVME: self._config.nvme_bytes}
        for index, size in sizes.items():
            spec = TierSpec(
                index=index,
                block_count=size // BLOCK_SIZE,
                persistent=index == NVME,
                key_generation=nvme_generation if index == NVME else None,
            )
            devices = self.factory(name, spec)
            tiers.append(Tier.build(spec, devices, self._config.eviction_policy))
        ts = TenantState(name=name, tenant_id=tid, tiers=tiers, quota_bytes=quota_bytes)
        self._by_name[name] = ts
        self._by_id[tid] = ts
        return ts

    def forget(self, ts: TenantState) -> None:
        """Unregister the tenant and close its devices (its records are the caller's)."""
        del self._by_name[ts.name], self._by_id[ts.tenant_id]
        for tier in ts.tiers:
            tier.device.close()

    def erase(self, name: str) -> bool:
        """Crypto-erase a forgotten tenant through the factory, where it can (the embedded
        one); True when its key was destroyed."""
        erase = getattr(self.factory, "erase", None)
        return bool(erase(name)) if erase is not None else False
