"""Cluster membership through a real Serf agent, and the placement every node computes from it.

`SerfClient` speaks Serf's RPC (codec in kvproto.serf); `SerfProcess` runs a `serf agent`
child; `Membership` keeps the agent's view of the cluster (tags published, members followed
through the RPC event stream, placement epoch) for the control server.
"""

from dpu_agent.cluster._agent import (
    agent_cluster_op,
    agent_cluster_reads,
    agent_cluster_view,
    agent_cut_off,
    agent_members_since,
    start_membership,
)
from dpu_agent.cluster._etcd import ETCD_CALL_TIMEOUT_S, EtcdClient, EtcdError, EtcdUnreachable
from dpu_agent.cluster._membership import (
    CAPACITY_BYTES_MAX,
    Membership,
    MembershipOptions,
    check_member,
    node_of,
)
from dpu_agent.cluster._peer import PeerAuth, open_peer
from dpu_agent.cluster._plan import OwnerTable, plan
from dpu_agent.cluster._rebalance import (
    RebalanceProgress,
    Rebalancer,
    ReceiveLimiter,
    tenant_keys,
)
from dpu_agent.cluster._serf_client import (
    RECORDS_MAX,
    KeyringReply,
    SerfClient,
    SerfUnreachable,
)
from dpu_agent.cluster._serf_process import SerfProcess, free_port
from dpu_agent.cluster._tenants import (
    TENANT_CHANGES_APPLIED,
    TENANT_TOKEN_BYTES,
    TenantPlanStep,
    TenantRecord,
    TenantSource,
    TenantSync,
    plan_tenants,
    tenant_source,
)

__all__ = [
    "CAPACITY_BYTES_MAX",
    "ETCD_CALL_TIMEOUT_S",
    "RECORDS_MAX",
    "TENANT_CHANGES_APPLIED",
    "TENANT_TOKEN_BYTES",
    "EtcdClient",
    "EtcdError",
    "EtcdUnreachable",
    "KeyringReply",
    "Membership",
    "MembershipOptions",
    "OwnerTable",
    "PeerAuth",
    "RebalanceProgress",
    "Rebalancer",
    "ReceiveLimiter",
    "SerfClient",
    "SerfProcess",
    "SerfUnreachable",
    "TenantPlanStep",
    "TenantRecord",
    "TenantSource",
    "TenantSync",
    "agent_cluster_op",
    "agent_cluster_reads",
    "agent_cluster_view",
    "agent_cut_off",
    "agent_members_since",
    "check_member",
    "free_port",
    "node_of",
    "open_peer",
    "plan",
    "plan_tenants",
    "start_membership",
    "tenant_keys",
    "tenant_source",
]
