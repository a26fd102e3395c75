"""The agent's side of the cluster: start membership with the agent's addresses, answer
`members` and the epoch check. Kept here so dpu_agent.service only calls in."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from dpu_agent.cluster._membership import Membership, MembershipOptions
from dpu_agent.cluster._rebalance import Rebalancer

__all__ = ["agent_cluster_op", "agent_cluster_reads", "agent_cluster_view", "start_membership"]

_WILDCARDS = ("0.0.0.0", "::", "")


def _advertised(address: str, advertise_host: str) -> str:
    """`address` (tcp://host:port or host:port) with a wildcard or chosen host replaced."""
    url = address if "://" in address else f"tcp://{address}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    if advertise_host or host in _WILDCARDS:
        host = advertise_host or "127.0.0.1"
    hostport = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    return f"tcp://{hostport}" if "://" in address else hostport


def start_membership(agent: Any) -> Membership:
    """Blocking (Serf starts, joins, publishes tags): call through asyncio.to_thread."""
    cfg = agent.cfg
    c = cfg.cluster
    addr = agent.addresses()
    opts = MembershipOptions(c, cfg.data_dir)
    m = Membership(
        opts,
        node=cfg.agent.node_name,
        control=_advertised(addr["control_tcp"], c.advertise_host),
        nvme=_advertised(addr["nvmf"], c.advertise_host) if addr["nvmf"] else "",
        capacity_bytes=max(1, cfg.storage.dram_bytes + cfg.storage.nvme_bytes),
    )
    m.start()

    def tenants() -> dict[str, tuple[str, int]]:
        return {name: (t.token, t.replicas or c.replicas) for name, t in cfg.tenants.items()}

    m.rebalancer = Rebalancer(
        engine=agent.engine, node=m.node, placement=lambda: m.placement, tenants=tenants,
        bytes_per_s=c.rebalance_bytes_per_s, receive_bytes_per_s=c.rebalance_receive_bytes_per_s,
        interval_s=c.anti_entropy_interval_s,
    )  # fmt: skip
    m.rebalancer.start()
    return m


def agent_cluster_view(agent: Any, tenant: str) -> dict[str, Any]:
    """`members` extras: epoch, serving count, and the session tenant's replica count."""
    m: Membership | None = agent.cluster
    if m is None:
        return {}
    replicas = _replicas(agent, tenant)
    view = m.view()
    rebalance = m.rebalancer.progress.as_dict() if m.rebalancer is not None else {}
    return {"epoch": view["epoch"], "serving": view["serving"], "replicas": replicas,
            "node": m.node, "rebalance": rebalance}  # fmt: skip


def _replicas(agent: Any, tenant: str) -> int:
    cfg = agent.cfg
    t = cfg.tenants.get(tenant)
    return (t.replicas if t is not None and t.replicas else 0) or cfg.cluster.replicas


def agent_cluster_op(agent: Any, tenant: str, op: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Agent-to-agent ops of the rebalancer: `cluster_grant` (the receive-side rate),
    `cluster_digest` (anti-entropy), `cluster_hot` (which copies beyond R are still hot).
    ValueError outside a cluster."""
    m: Membership | None = agent.cluster
    if m is None or m.rebalancer is None:
        raise ValueError(f"{op}: this agent is not in a cluster")
    r: Rebalancer = m.rebalancer
    if op == "cluster_grant":
        return {"wait_s": r.receiver.grant(int(fields["bytes"]))}
    if op == "cluster_hot":
        return {"hot": r.hot_indexes(tenant, list(fields["keys"]))}
    assert op == "cluster_digest", op
    return r.answer_digest(tenant, _replicas(agent, tenant), dict(fields))


def agent_cluster_reads(agent: Any, tenant: str, keys: list[bytes]) -> list[int]:
    """Reads served here (from every client): the indexes of `keys` that are hot."""
    m: Membership | None = agent.cluster
    if m is None or m.rebalancer is None:
        return []
    return m.rebalancer.note_reads(tenant, keys)
