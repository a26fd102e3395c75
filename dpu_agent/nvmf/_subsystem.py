"""Subsystems the target exports and the options it runs with (SPDK's defaults, named as SPDK)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice
from dpu_agent.nvmf._host_keys import HostKeys
from kvproto.nvme import DISCOVERY_NQN, NQN_BYTES_MAX

__all__ = [
    "DISCOVERY_NQN",
    "TENANT_NQN_PREFIX",
    "Subsystem",
    "TargetOptions",
    "namespace_ids",
    "tenant_nqn",
]

TENANT_NQN_PREFIX = "nqn.2026-11.io.dpu-kvtier:tenant:"  # docs/ARCHITECTURE.md

MODEL_DEFAULT = "dpu-kvtier namespace"


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetOptions:
    """Transport options; names and defaults follow SPDK's `nvmf_create_transport -t TCP`.

    `max_io_size` is advertised as MDTS and enforced; KV chunks are large, so 1 MiB or more is
    the useful setting here (SPDK's default is 128 KiB).
    """

    max_queue_depth: int = 128
    max_aq_depth: int = 128
    max_io_qpairs_per_ctrlr: int = 127
    in_capsule_data_size: int = 4096
    max_io_size: int = 131072
    c2h_success: bool = True  # SPDK's default: skip the CapsuleResp after a successful read
    # KAS: keep-alive granularity; SPDK rounds KATO up to a multiple of 10 s (kas 100, units of
    # 100 ms). Tests use a smaller one to see a timeout quickly.
    keep_alive_granularity_ms: int = 10000
    # Data buffers of max_io_size per I/O queue: commands beyond this wait for one (memory per
    # queue is bounded to data_buffers_per_queue * max_io_size).
    data_buffers_per_queue: int = 8
    # Threads doing device I/O (encryption releases the GIL); bounded so a slow device cannot
    # take every CPU from the event loop.
    io_workers: int = 4

    def __post_init__(self) -> None:
        if self.max_io_size < BLOCK_SIZE or self.max_io_size & (self.max_io_size - 1):
            raise ValueError(f"max_io_size {self.max_io_size} must be a power of two >= 4096")
        if not 4096 <= self.in_capsule_data_size <= 131072 or self.in_capsule_data_size % 16:
            raise ValueError(f"in_capsule_data_size {self.in_capsule_data_size} not in 4096..128K")
        if not 2 <= self.max_queue_depth <= 65536 or not 2 <= self.max_aq_depth <= 4096:
            raise ValueError("max_queue_depth/max_aq_depth out of range")
        if not 1 <= self.max_io_qpairs_per_ctrlr <= 65534:
            raise ValueError(f"max_io_qpairs_per_ctrlr {self.max_io_qpairs_per_ctrlr} bad")
        if self.keep_alive_granularity_ms < 100 or self.keep_alive_granularity_ms % 100:
            raise ValueError("keep_alive_granularity_ms must be a multiple of 100 ms")
        if self.data_buffers_per_queue < 1 or self.io_workers < 1:
            raise ValueError("data_buffers_per_queue and io_workers must be >= 1")

    @property
    def mdts(self) -> int:
        """MDTS: log2 of max_io_size in units of CAP.MPSMIN (4 KiB)."""
        return (self.max_io_size // BLOCK_SIZE).bit_length() - 1


@dataclass(eq=False)
class Subsystem:
    """An NVMe subsystem: its NQN, who may connect, and its namespaces (nsid -> device).

    `allowed_hosts` are host NQNs; with `allow_any_host` everyone may connect (SPDK's flag).
    The namespace map may change while the target runs; hosts see the new set on their next
    Identify.
    """

    nqn: str
    allowed_hosts: set[str] = field(default_factory=set)
    namespaces: dict[int, BlockDevice] = field(default_factory=dict)
    # host NQN -> the peer addresses it may connect from (the agent binds each allowed host
    # to its authenticated control session's address); a host not named here: any address
    host_peers: dict[str, frozenset[str]] = field(default_factory=dict)
    allow_any_host: bool = False
    serial: str = ""
    model: str = MODEL_DEFAULT
    # DH-HMAC-CHAP / TLS keys per host NQN; with require_auth every host must authenticate
    # (a host without a key cannot), see docs/NVME_AUTH.md
    host_keys: dict[str, HostKeys] = field(default_factory=dict)
    require_auth: bool = False
    secure_channel: bool = False  # hosts must come over TLS (a secure_channel target)
    # (nsid, lba, count) -> whether hosts may write there; None: anywhere (a plain target).
    # The agent's tenants: only inside their open reservations (Engine.write_gate)
    write_gate: Callable[[int, int, int], bool] | None = None

    def __post_init__(self) -> None:
        raw = self.nqn.encode()
        if not 0 < len(raw) <= NQN_BYTES_MAX or not self.nqn.startswith("nqn."):
            raise ValueError(f"subsystem NQN {self.nqn!r}: must start with 'nqn.', <= 223 bytes")
        if self.nqn == DISCOVERY_NQN:
            raise ValueError("the discovery subsystem is built in; do not add it")
        for nsid, dev in self.namespaces.items():
            check_namespace(nsid, dev)
        if not self.serial:
            self.serial = hashlib.sha256(raw).hexdigest()[:20].upper()
        if len(self.serial) > 20 or len(self.model) > 40:
            raise ValueError("serial is at most 20 and model at most 40 ASCII characters")

    def host_allowed(self, hostnqn: str, peer_ip: str | None = None) -> bool:
        """`peer_ip` None: whether the NQN is listed at all (the discovery log)."""
        if self.allow_any_host:
            return True
        if hostnqn not in self.allowed_hosts:
            return False
        peers = self.host_peers.get(hostnqn)
        return peer_ip is None or peers is None or peer_ip in peers


def tenant_nqn(tenant: str) -> str:
    """The subsystem NQN of a tenant's namespaces (one subsystem per tenant)."""
    nqn = TENANT_NQN_PREFIX + tenant
    if not tenant or len(nqn.encode()) > NQN_BYTES_MAX or any(c.isspace() for c in tenant):
        raise ValueError(f"tenant {tenant!r} gives no valid NQN (non-empty, no spaces, short)")
    return nqn


def check_namespace(nsid: int, dev: BlockDevice) -> None:
    if not 1 <= nsid <= 0xFFFFFFFE:
        raise ValueError(f"nsid {nsid} must be 1..0xFFFFFFFE")
    if dev.block_size != BLOCK_SIZE:
        raise ValueError(f"nsid {nsid}: block size {dev.block_size}, target serves {BLOCK_SIZE}")


def namespace_ids(subnqn: str, nsid: int) -> tuple[bytes, bytes]:
    """(NGUID, UUID) of a namespace: stable, derived from the subsystem NQN and the nsid."""
    digest = hashlib.sha256(f"{subnqn}\0{nsid}".encode()).digest()
    return digest[:16], uuid.UUID(bytes=digest[16:32], version=4).bytes
