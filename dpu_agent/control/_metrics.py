"""Control-plane metrics, registered once on the agent's REGISTRY (dpu_agent.metrics)."""

from __future__ import annotations

from dpu_agent.metrics import REGISTRY, Counter, Gauge, Histogram

__all__ = [
    "AUTH_FAILURES",
    "COMMITTED_BYTES",
    "CONNECTIONS",
    "HIT_RATIO",
    "INTEGRITY_REPORTS",
    "LEASED_BYTES",
    "LEASES_ACTIVE",
    "PROTOCOL_ERRORS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "RESERVATIONS_ACTIVE",
]

# Buckets from 25 us (a DRAM-tier lookup) to 10 s (a checkpoint or backup).
_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1, 10)

REQUESTS = Counter(
    "kvtier_control_requests",
    "Control-plane requests by op and result code (ok or the error code).",
    ["op", "code"],
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "kvtier_control_request_seconds",
    "Control-plane request latency inside the agent, by op.",
    ["op"],
    buckets=_BUCKETS_S,
    registry=REGISTRY,
)
CONNECTIONS = Gauge(
    "kvtier_control_connections", "Open control-plane connections.", registry=REGISTRY
)
AUTH_FAILURES = Counter(
    "kvtier_control_auth_failures",
    "Refused hellos and requests by reason (token, version, before_hello, forbidden).",
    ["reason"],
    registry=REGISTRY,
)
PROTOCOL_ERRORS = Counter(
    "kvtier_control_protocol_errors",
    "Malformed frames or requests from clients.",
    registry=REGISTRY,
)
HIT_RATIO = Gauge(
    "kvtier_hit_ratio",
    "Chunk hit ratio of control-plane lookups since the agent started, by tenant "
    "(hits and misses themselves: kvtier_engine_lookup_chunks_total).",
    ["tenant"],
    registry=REGISTRY,
)
LEASED_BYTES = Counter(
    "kvtier_bytes_out",
    "Bytes handed out to readers (leased hits), by tenant.",
    ["tenant"],
    registry=REGISTRY,
)
COMMITTED_BYTES = Counter(
    "kvtier_bytes_in",
    "Bytes committed by writers, by tenant.",
    ["tenant"],
    registry=REGISTRY,
)
LEASES_ACTIVE = Gauge(
    "kvtier_leases_active", "Read leases held now (all tenants).", registry=REGISTRY
)
RESERVATIONS_ACTIVE = Gauge(
    "kvtier_reservations_active",
    "Uncommitted write reservations now (all tenants).",
    registry=REGISTRY,
)
INTEGRITY_REPORTS = Counter(
    "kvtier_client_integrity_failures",
    "Chunks a client read whose checksum did not match (dropped), by tenant.",
    ["tenant"],
    registry=REGISTRY,
)

CONNECTIONS_REFUSED = Counter(
    "kvtier_control_connections_refused",
    "Control connections refused or closed by a limit",
    ["reason"],
    registry=REGISTRY,
)
