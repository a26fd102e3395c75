"""make_policy: policy objects by name."""

from __future__ import annotations

from collections.abc import Callable

from dpu_agent.eviction._arc import ArcPolicy
from dpu_agent.eviction._clock import ClockPolicy
from dpu_agent.eviction._elect import ElectPolicy
from dpu_agent.eviction._lru import Lru2Policy, LruPolicy
from dpu_agent.eviction._policy import CAPACITY_ITEMS_MAX, EvictionPolicy
from dpu_agent.eviction._prefix import PrefixPolicy
from dpu_agent.eviction._prefix_run import RunAwarePrefixPolicy
from dpu_agent.eviction._s3fifo import S3FifoPolicy

__all__ = ["DEFAULT_POLICY", "FIXED_POLICY_NAMES", "POLICY_NAMES", "make_policy"]

DEFAULT_POLICY = "elect"  # docs/EVICTION.md, "The default": better on the bar on data not chosen on

_FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LruPolicy,
    "lru2": Lru2Policy,
    "clock": ClockPolicy,
    "s3fifo": S3FifoPolicy,
    "arc": ArcPolicy,
    "prefix": PrefixPolicy,
    "prefix-run": RunAwarePrefixPolicy,
    "elect": ElectPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
# The policies that order by a rule of their own; `elect` follows one of them.
FIXED_POLICY_NAMES: tuple[str, ...] = tuple(n for n in POLICY_NAMES if n != "elect")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new, empty policy; `capacity` (items) sizes its ghost lists and queues."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid names: {', '.join(POLICY_NAMES)}"
        )
    if not 0 < capacity <= CAPACITY_ITEMS_MAX:
        raise ValueError(
            f"eviction capacity must be an item count in 1..{CAPACITY_ITEMS_MAX}, got {capacity}"
        )
    return factory(capacity)
