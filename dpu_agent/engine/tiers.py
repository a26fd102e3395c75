"""Tiers: the devices one tenant's chunks live on, built by an injectable factory.

Embedded mode (the default factory) gives each tenant a DRAM tier (an anonymous mmap) and an
NVMe tier (a file, `<nvme_dir>/<tenant>/nvme.img`), each wrapped in AES-XTS with the tenant's own
key, so the backing file holds only ciphertext. SPDK mode passes other devices (a namespace over
NVMe/TCP whose crypto vbdev encrypts on the DPU): any `BlockDevice` works.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpu_agent.blockdev import (
    BLOCK_SIZE,
    WRITEBACK_AFTER_BYTES,
    BlockDevice,
    FileBlockDevice,
    MemoryBlockDevice,
)
from dpu_agent.crypto import CryptoBlockDevice, KeyStore, XtsCipher
from dpu_agent.crypto.keystore import KeyStoreError, env_var_name
from dpu_agent.engine.alloc import ExtentAllocator
from dpu_agent.eviction import EvictionPolicy, make_policy

__all__ = [
    "DRAM",
    "NVME",
    "TIER_NAMES",
    "DeviceFactory",
    "EmbeddedDevices",
    "Tier",
    "TierDevices",
    "TierSpec",
]

DRAM = 0  # tier index: hot, volatile (nsid 1)
NVME = 1  # tier index: persistent (nsid 2)
TIER_NAMES = ("dram", "nvme")


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSpec:
    index: int  # DRAM or NVME
    block_count: int
    persistent: bool
    # the key generation the tier's existing data was written under (None: the current one);
    # a restart must open the NVMe tier with it, not with a key rotated since
    key_generation: int | None = None

    @property
    def nsid(self) -> int:
        return self.index + 1

    @property
    def name(self) -> str:
        return TIER_NAMES[self.index]


@dataclass(frozen=True, slots=True, kw_only=True)
class TierDevices:
    """`device` is what chunks are read and written through (plaintext side); `raw` is what is
    stored (ciphertext side, for backups). They are the same object when the device encrypts
    elsewhere (SPDK's crypto vbdev)."""

    device: BlockDevice
    raw: BlockDevice
    key_generation: int = 0


DeviceFactory = Callable[[str, TierSpec], TierDevices]


class EmbeddedDevices:
    """The embedded-mode factory: MemoryBlockDevice / FileBlockDevice under AES-XTS."""

    def __init__(
        self,
        nvme_dir: str | Path,
        keystore: KeyStore,
        *,
        writeback_after_bytes: int = WRITEBACK_AFTER_BYTES,
    ) -> None:
        self.nvme_dir = Path(nvme_dir)
        self.keystore = keystore
        self.writeback_after_bytes = writeback_after_bytes

    def nvme_path(self, tenant: str) -> Path:
        return self.nvme_dir / tenant / "nvme.img"

    def prepare(self, tenants: list[str]) -> None:
        """Before new tenants' devices are built: their keys, in one write of the key file."""
        self.keystore.create_missing(tenants)

    def require_key(self, tenant: str, generation: int) -> None:
        """Before a tenant whose NVMe tier holds chunks under `generation` is built: that key
        must exist. Built without it, the tenant got a new key silently and every chunk failed
        its check on read and was quarantined (a key file deleted, emptied or replaced)."""
        if not self.keystore.has_key(tenant, generation):
            where = self.keystore.path or f"the environment ({env_var_name(tenant)})"
            raise KeyStoreError(
                f"tenant {tenant!r} has chunks in {self.nvme_path(tenant)} written under key "
                f"generation {generation}, and {where} holds no such key: the key file was "
                "deleted, emptied or replaced. Restore it from a backup and start again; to "
                "give up the tenant's data instead, remove the tenant from the configuration, "
                "start (its data is erased), then add it back"
            )

    def erase(self, tenant: str) -> bool:
        """Crypto-erase a removed tenant (its devices already closed): destroy its XTS keys
        and delete its NVMe file. False when the key comes from the environment (the agent
        cannot destroy it: the operator must)."""
        from_env = self.keystore.has_env_key(tenant)
        self.keystore.remove(tenant)
        path = self.nvme_path(tenant)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        return not from_env

    def __call__(self, tenant: str, spec: TierSpec) -> TierDevices:
        raw: BlockDevice
        if spec.persistent:
            path = self.nvme_path(tenant)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            raw = FileBlockDevice(
                path, spec.block_count, writeback_after_bytes=self.writeback_after_bytes
            )
        else:
            raw = MemoryBlockDevice(spec.block_count)
        generation = spec.key_generation
        if generation is None:
            generation = self.keystore.current_generation(tenant)
        cipher = XtsCipher(self.keystore.key_for(tenant, generation), block_size=BLOCK_SIZE)
        return TierDevices(
            device=CryptoBlockDevice(raw, cipher), raw=raw, key_generation=generation
        )


@dataclass(slots=True, kw_only=True)
class Tier:
    """One tier of one tenant: devices, allocator, eviction order and quarantined extents."""

    spec: TierSpec
    devices: TierDevices
    alloc: ExtentAllocator
    policy: EvictionPolicy
    quarantined: dict[int, int] = field(default_factory=dict)  # lba -> block_count
    # policy item -> row of each chunk the policy tracks (items are key hashes, see _records)
    rows: dict[int, int] = field(default_factory=dict)
    # recovered chunks not used since the restart, in eviction order (seq << 32 | row each);
    # filling the policy with a million records one by one takes seconds, so they wait here
    # (after a clean stop the hottest are adopted at start, `_restart_order`; skipped here)
    cold: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    cold_pos: int = 0
    records: int = 0
    used_blocks_records: int = 0  # blocks held by committed records (not reservations)

    @classmethod
    def build(cls, spec: TierSpec, devices: TierDevices, policy_name: str) -> Tier:
        if devices.device.block_size != BLOCK_SIZE:
            raise ValueError(
                f"{spec.name} device block size {devices.device.block_size} != {BLOCK_SIZE}; "
                "format the namespace with 4096-byte blocks"
            )
        return cls(
            spec=spec,
            devices=devices,
            alloc=ExtentAllocator(devices.device.block_count),
            policy=make_policy(policy_name, max(1, devices.device.block_count)),
        )

    @property
    def device(self) -> BlockDevice:
        return self.devices.device

    @property
    def quarantined_blocks(self) -> int:
        return sum(self.quarantined.values())
