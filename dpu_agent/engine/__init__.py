"""The storage engine: chunk index, tiers, leases, two-phase writes, journal and backups.

See docs/ENGINE.md for the design, limits and durability policy.
"""

from dpu_agent.engine.alloc import AllocError, ExtentAllocator
from dpu_agent.engine.engine import Engine
from dpu_agent.engine.errors import (
    ChecksumMismatch,
    EngineError,
    JournalUnavailable,
    LeaseExpired,
    LimitExceeded,
    QuotaExceeded,
    ReservationExpired,
    TierFull,
    UnknownKey,
    UnknownTenant,
)
from dpu_agent.engine.index import RecordIndex
from dpu_agent.engine.journal import Journal, JournalError
from dpu_agent.engine.recovery import RecoveryReport
from dpu_agent.engine.tiers import (
    DRAM,
    NVME,
    DeviceFactory,
    EmbeddedDevices,
    TierDevices,
    TierSpec,
)
from dpu_agent.engine.types import (
    ChunkLocation,
    EngineConfig,
    LookupResult,
    Reservation,
)

__all__ = [
    "DRAM",
    "NVME",
    "AllocError",
    "ChecksumMismatch",
    "ChunkLocation",
    "DeviceFactory",
    "EmbeddedDevices",
    "Engine",
    "EngineConfig",
    "EngineError",
    "ExtentAllocator",
    "Journal",
    "JournalError",
    "JournalUnavailable",
    "LeaseExpired",
    "LimitExceeded",
    "LookupResult",
    "QuotaExceeded",
    "RecordIndex",
    "RecoveryReport",
    "Reservation",
    "ReservationExpired",
    "TierDevices",
    "TierFull",
    "TierSpec",
    "UnknownKey",
    "UnknownTenant",
]
