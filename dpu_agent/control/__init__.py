"""The agent's control server: length-prefixed msgpack frames over TCP and a Unix socket.

The wire format and operations are in kvproto.control; this package authenticates tenants,
scopes every request to its session's tenant, calls the engine and answers.
"""

from dpu_agent.control._auth import TENANTS_MAX, TenantRegistry
from dpu_agent.control._dispatch import (
    ControlBackend,
    Dispatcher,
    Session,
    host_nqn_problem,
    plain,
)
from dpu_agent.control._metrics import LEASES_ACTIVE, RESERVATIONS_ACTIVE
from dpu_agent.control._server import UNAUTHENTICATED_MAX, UNIX_CONNECTIONS_MAX, ControlServer

__all__ = [
    "LEASES_ACTIVE",
    "RESERVATIONS_ACTIVE",
    "TENANTS_MAX",
    "UNAUTHENTICATED_MAX",
    "UNIX_CONNECTIONS_MAX",
    "ControlBackend",
    "ControlServer",
    "Dispatcher",
    "Session",
    "TenantRegistry",
    "host_nqn_problem",
    "plain",
]
