"""Engine errors: operating errors a caller can act on; messages name the value and the fix."""

from __future__ import annotations

__all__ = [
    "ChecksumMismatch",
    "EngineError",
    "JournalUnavailable",
    "LeaseExpired",
    "LimitExceeded",
    "QuotaExceeded",
    "ReservationExpired",
    "TierFull",
    "UnknownKey",
    "UnknownTenant",
]


class EngineError(Exception):
    """Base of every operating error the engine raises."""


class TierFull(EngineError):
    """No tier has room for a chunk even after eviction (everything left is pinned or leased)."""


class UnknownKey(EngineError):
    """The tenant has no committed chunk under this key."""


class LeaseExpired(EngineError):
    """A lease was released after its TTL ran out (its extents may have been reused)."""


class ReservationExpired(EngineError):
    """A commit came after the reservation's TTL; its extent was reclaimed."""


class ChecksumMismatch(EngineError):
    """Stored bytes do not match the record's checksum; the extent is quarantined."""


class UnknownTenant(EngineError):
    """The tenant was never added to this engine."""


class QuotaExceeded(EngineError):
    """The tenant's byte quota is used up by chunks that cannot be evicted."""


class LimitExceeded(EngineError):
    """A bounded table (leases, reservations, tenants, keys per request) is full."""


class JournalUnavailable(EngineError):
    """The journal cannot take writes (disk full, I/O error): the engine refuses writes until a
    probe shows it writable again; reads go on. `full` is True when the disk is full."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full
