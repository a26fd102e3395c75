"""Cluster membership through a real Serf agent, and the placement every node computes from it.

`SerfClient` speaks Serf's RPC (codec in kvproto.serf); `SerfProcess` runs a `serf agent`
child; `Membership` keeps the agent's view of the cluster (tags published, members followed
through the RPC event stream, placement epoch) for the control server.
"""

from dpu_agent.cluster._agent import (
    agent_cluster_op,
    agent_cluster_reads,
    agent_cluster_view,
    start_membership,
)
from dpu_agent.cluster._membership import Membership, MembershipOptions, node_of
from dpu_agent.cluster._plan import OwnerTable, plan
from dpu_agent.cluster._rebalance import RebalanceProgress, Rebalancer, tenant_keys
from dpu_agent.cluster._serf_client import RECORDS_MAX, SerfClient, SerfUnreachable
from dpu_agent.cluster._serf_process import SerfProcess, free_port

__all__ = [
    "RECORDS_MAX",
    "Membership",
    "MembershipOptions",
    "OwnerTable",
    "RebalanceProgress",
    "Rebalancer",
    "SerfClient",
    "SerfProcess",
    "SerfUnreachable",
    "agent_cluster_op",
    "agent_cluster_reads",
    "agent_cluster_view",
    "free_port",
    "node_of",
    "plan",
    "start_membership",
    "tenant_keys",
]
