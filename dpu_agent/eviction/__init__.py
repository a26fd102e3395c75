"""Eviction policies for the agent's tiers (see docs/EVICTION.md).

Items are integer ids. A tier calls `insert`, `access` and `remove` as chunks come and go, and
`victim(evictable)` when it needs room; `make_policy(name, capacity)` builds one by name.
"""

from dpu_agent.eviction._arc import ArcPolicy
from dpu_agent.eviction._clock import ClockPolicy
from dpu_agent.eviction._elect import ElectPolicy
from dpu_agent.eviction._lru import Lru2Policy, LruPolicy
from dpu_agent.eviction._policy import (
    CAPACITY_ITEMS_MAX,
    Evictable,
    EvictionPolicy,
    Ordering,
    Resident,
)
from dpu_agent.eviction._prefix import PrefixPolicy
from dpu_agent.eviction._prefix_run import RunAwarePrefixPolicy
from dpu_agent.eviction._registry import (
    DEFAULT_POLICY,
    FIXED_POLICY_NAMES,
    POLICY_NAMES,
    make_policy,
)
from dpu_agent.eviction._s3fifo import S3FifoPolicy

__all__ = [
    "CAPACITY_ITEMS_MAX",
    "DEFAULT_POLICY",
    "FIXED_POLICY_NAMES",
    "POLICY_NAMES",
    "ArcPolicy",
    "ClockPolicy",
    "ElectPolicy",
    "Evictable",
    "EvictionPolicy",
    "Lru2Policy",
    "LruPolicy",
    "Ordering",
    "PrefixPolicy",
    "Resident",
    "RunAwarePrefixPolicy",
    "S3FifoPolicy",
    "make_policy",
]
