"""The engine's value types: configuration, what callers get back, and per-tenant state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpu_agent.blockdev import WRITEBACK_AFTER_BYTES
from dpu_agent.engine.tiers import Tier
from dpu_agent.eviction import DEFAULT_POLICY

__all__ = [
    "ChunkLocation",
    "EngineConfig",
    "Lease",
    "LookupResult",
    "PendingReservation",
    "Reservation",
    "TenantState",
]


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Sizes are per tenant. Paths default to places under data_dir."""

    data_dir: Path
    dram_bytes: int = 256 << 20
    nvme_bytes: int = 2 << 30
    eviction_policy: str = DEFAULT_POLICY
    lease_ttl_s: float = 30.0
    reservation_ttl_s: float = 30.0
    fsync_interval_s: float = 1.0  # group commit: WAL and NVMe tier fsynced this often by tick()
    # tick() checkpoints when the WAL segment passes this: 16 MiB = 180k frames, which replay
    # in about 0.3 s; with a 1M-record checkpoint that keeps restart near 1 s
    checkpoint_wal_bytes: int = 16 << 20
    # tick() saves each tenant's eviction order this often (and close() at a clean stop), for
    # the next start to take over after a crash too (engine/_restart_order.py): 131k items cost
    # about 0.1 s under the lock at most and 0.5 s of ordering and writing outside it
    policy_order_save_s: float = 60.0
    # tick() demotes DRAM chunks (copying outside the lock) until this share of DRAM is free,
    # so reserve() rarely has to demote inline, under the lock
    dram_free_fraction: float = 0.1
    # the NVMe tier's file starts the kernel's write-out after this many bytes written, so the
    # group commit's fsync finds little left to flush (0: leave everything to that fsync)
    writeback_after_bytes: int = WRITEBACK_AFTER_BYTES
    nvme_dir: Path | None = None  # default data_dir: <nvme_dir>/<tenant>/nvme.img
    journal_dir: Path | None = None  # default data_dir/journal
    key_file: Path | None = None  # default data_dir/keys.json
    tenants: dict[str, int] = field(default_factory=dict)  # name -> quota_bytes (0: none)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        for name in ("dram_bytes", "nvme_bytes"):
            value = getattr(self, name)
            if value < 4096 or value % 4096:
                raise ValueError(f"{name}={value}: give a positive multiple of 4096 bytes")
        if not self.policy_order_save_s > 0:
            raise ValueError(f"policy_order_save_s={self.policy_order_save_s}: give > 0 seconds")
        if self.writeback_after_bytes < 0:
            raise ValueError(f"writeback_after_bytes={self.writeback_after_bytes}: give >= 0")

    @property
    def nvme_path(self) -> Path:
        return Path(self.nvme_dir) if self.nvme_dir is not None else self.data_dir

    @property
    def journal_path(self) -> Path:
        return Path(self.journal_dir) if self.journal_dir is not None else self.data_dir / "journal"

    @property
    def key_path(self) -> Path:
        return Path(self.key_file) if self.key_file is not None else self.data_dir / "keys.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkLocation:
    """Where a chunk's blocks are: namespace `nsid` (1 DRAM, 2 NVMe) of the tenant."""

    key: bytes
    nsid: int
    lba: int
    block_count: int
    length: int
    checksum: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """The longest cached prefix; `lease_id` is None when nothing was found (no lease taken).
    `lease_expires_s` is seconds from now."""

    hits: list[ChunkLocation]
    lease_id: int | None
    lease_expires_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """Blocks to write before commit(); `expires_s` is seconds from now."""

    reservation_id: int
    nsid: int
    lba: int
    block_count: int
    expires_s: float


@dataclass(slots=True, kw_only=True)
class Lease:
    lease_id: int
    tenant_id: int
    extents: list[tuple[int, int, int, int]]  # (tier, lba, block_count, row)
    expires: float  # engine clock


@dataclass(slots=True, kw_only=True)
class PendingReservation:
    reservation_id: int
    tenant_id: int
    key: bytes
    length: int
    parent: bytes | None
    tier: int
    lba: int
    block_count: int
    expires: float  # engine clock


@dataclass(slots=True, kw_only=True)
class TenantState:
    name: str
    tenant_id: int
    tiers: list[Tier]
    quota_bytes: int = 0
    reserved_blocks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0  # NVMe -> DRAM moves of chunks that turned hot
    integrity_failures: int = 0

    @property
    def used_blocks(self) -> int:
        return self.reserved_blocks + sum(t.used_blocks_records for t in self.tiers)
