"""The agent's Prometheus registry. Every module registers its metrics here, once, at import.

A private registry (not prometheus_client's global one) so tests and benchmarks that build
several engines in one process read what they expect; `REGISTRY` is what the agent's
/metrics endpoint serves.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["REGISTRY", "Counter", "Gauge", "Histogram", "forget_tenant", "on_forget_tenant",
           "sample_value"]  # fmt: skip

REGISTRY = CollectorRegistry(auto_describe=True)
TENANT_LABEL = "tenant"
# Modules that cache label children per tenant drop them here, so a tenant added again under
# the same name gets children that are registered
_FORGET_HOOKS: list[Callable[[str], None]] = []


def on_forget_tenant(hook: Callable[[str], None]) -> Callable[[str], None]:
    _FORGET_HOOKS.append(hook)
    return hook


def forget_tenant(tenant: str) -> int:
    """Remove every series labelled with `tenant` (a removed tenant's series would otherwise be
    exported, frozen, until the agent restarts); returns how many went. prometheus_client has
    no public way to list a metric's children: its `_labelnames`/`_metrics` are read here."""
    removed = 0
    for collector in list(REGISTRY._collector_to_names):
        names = tuple(getattr(collector, "_labelnames", ()))
        if TENANT_LABEL not in names:
            continue
        at = names.index(TENANT_LABEL)
        for values in list(getattr(collector, "_metrics", {})):
            if values[at] == tenant:
                collector.remove(*values)  # type: ignore[attr-defined]
                removed += 1
    for hook in _FORGET_HOOKS:
        hook(tenant)
    return removed


def sample_value(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of one sample (0.0 when absent); for stats output and tests."""
    value = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)
