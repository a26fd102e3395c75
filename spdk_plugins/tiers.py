"""agent_tiers: which NVMe-oF namespace the agent reaches each tenant's tier through.

In SPDK mode the agent does not open bdevs itself: SPDK exports each tenant's tiers as
namespaces of the tenant's subsystem, and the agent connects to them with its own NVMe/TCP
initiator (`host_shim.nvme.NvmeTcpController`) on the DPU's loopback listener, then wraps each
namespace as `NvmeTcpBlockDevice(controller, nsid)` for the engine.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from spdk_plugins.desired import DesiredStateError, SpdkDesired

__all__ = ["TIER_NSID", "TierTarget", "agent_tiers"]

# The engine's namespaces (docs/ARCHITECTURE.md): extents name their tier by these nsids.
TIER_NSID = {"dram": 1, "nvme": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class TierTarget:
    tenant: str
    tier: str  # "dram" or "nvme"
    subnqn: str
    hostnqn: str
    traddr: str
    trsvcid: str
    adrfam: str
    nsid: int
    bdev_name: str

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def _is_loopback(traddr: str) -> bool:
    try:
        return ipaddress.ip_address(traddr).is_loopback
    except ValueError:
        return False


def agent_tiers(desired: SpdkDesired) -> list[TierTarget]:
    """Per tenant subsystem, one entry per namespace with a `tier`, in tenant then tier order."""
    out: list[TierTarget] = []
    for i, s in enumerate(desired.subsystems):
        tiered = [ns for ns in s.namespaces if ns.tier is not None]
        if not tiered:
            continue
        path = f"spdk.subsystems[{i}]"
        if s.tenant is None:
            raise DesiredStateError(f"{path}.tenant", "namespaces have a tier but no tenant")
        if desired.agent_hostnqn is None:
            raise DesiredStateError("spdk.agent_hostnqn", "needed for the agent's initiator")
        if not s.allow_any_host and desired.agent_hostnqn not in s.hosts:
            raise DesiredStateError(
                f"{path}.hosts", f"must list the agent's host NQN {desired.agent_hostnqn!r}"
            )
        loop = [x for x in s.listeners if x.trtype == "TCP" and _is_loopback(x.traddr)]
        if not loop:
            raise DesiredStateError(
                f"{path}.listeners", "no TCP listener on a loopback address for the agent"
            )
        for j, ns in enumerate(s.namespaces):
            if ns.tier is not None and TIER_NSID[ns.tier] != ns.nsid:
                raise DesiredStateError(
                    f"{path}.namespaces[{j}].nsid",
                    f"tier {ns.tier} must be nsid {TIER_NSID[ns.tier]}: the engine's extents "
                    "name it so, and hosts read them from this subsystem",
                )
        for ns in sorted(tiered, key=lambda n: n.nsid):
            assert ns.tier is not None
            out.append(
                TierTarget(
                    tenant=s.tenant,
                    tier=ns.tier,
                    subnqn=s.nqn,
                    hostnqn=desired.agent_hostnqn,
                    traddr=loop[0].traddr,
                    trsvcid=loop[0].trsvcid,
                    adrfam=loop[0].adrfam,
                    nsid=ns.nsid,
                    bdev_name=ns.bdev_name,
                )
            )
    return out
