"""The agent's Prometheus registry. Every module registers its metrics here, once, at import.

A private registry (not prometheus_client's global one) so tests and benchmarks that build
several engines in one process read what they expect; `REGISTRY` is what the agent's
/metrics endpoint serves.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["REGISTRY", "Counter", "Gauge", "Histogram", "sample_value"]

REGISTRY = CollectorRegistry(auto_describe=True)


def sample_value(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of one sample (0.0 when absent); for stats output and tests."""
    value = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)
