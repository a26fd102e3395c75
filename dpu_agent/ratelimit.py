"""Per-address token buckets: what the NVMe/TCP target's DH exchanges and the control plane's
TLS handshakes are rate-limited with (one address may not spend the CPU everyone shares)."""

from __future__ import annotations

__all__ = ["TokenBuckets"]


class TokenBuckets:
    """Per-address token buckets: `burst` at once, refilled at `rate` a second; at most
    `entries_max` addresses remembered (the least recently seen is forgotten: a full bucket)."""

    def __init__(self, burst: float, rate: float, entries_max: int) -> None:
        self.burst, self.rate, self.entries_max = burst, rate, entries_max
        self._b: dict[str, tuple[float, float]] = {}  # address -> (tokens, when), LRU order

    def take(self, address: str, now: float) -> bool:
        tokens, when = self._b.pop(address, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.rate)
        ok = tokens >= 1.0
        self._b[address] = (tokens - 1.0 if ok else tokens, now)
        while len(self._b) > self.entries_max:
            del self._b[next(iter(self._b))]
        return ok
