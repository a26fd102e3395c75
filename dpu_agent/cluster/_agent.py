"""The agent's side of the cluster: start membership with the agent's addresses, answer
`members` and the epoch check. Kept here so dpu_agent.service only calls in."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from dpu_agent.cluster._membership import Membership, MembershipOptions
from dpu_agent.cluster._reach import Reachability
from dpu_agent.cluster._rebalance import Rebalancer, ReceiveLimiter
from dpu_agent.cluster._views import ViewHistory
from kvproto.control import grant_bytes_problem

__all__ = [
    "agent_cluster_op",
    "agent_cluster_reads",
    "agent_cluster_view",
    "agent_cut_off",
    "agent_members_since",
    "start_membership",
]

_WILDCARDS = ("0.0.0.0", "::", "")


def _advertised(address: str, advertise_host: str) -> str:
    """`address` (tcp://, tls:// or host:port) with a wildcard or chosen host replaced; the
    scheme is kept (a TLS control plane is published as tls://: peers and clients must know)."""
    url = address if "://" in address else f"tcp://{address}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    if advertise_host or host in _WILDCARDS:
        host = advertise_host or "127.0.0.1"
    hostport = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    return f"{parts.scheme}://{hostport}" if "://" in address else hostport


def start_membership(agent: Any) -> Membership:
    """Blocking (Serf starts, joins, publishes tags): call through asyncio.to_thread."""
    cfg = agent.cfg
    c = cfg.cluster
    addr = agent.addresses()
    opts = MembershipOptions(cfg)
    m = Membership(
        opts,
        node=cfg.agent.node_name,
        control=_advertised(addr["control_tcp"], c.advertise_host),
        nvme=_advertised(addr["nvmf"], c.advertise_host) if addr["nvmf"] else "",
        capacity_bytes=max(1, cfg.storage.dram_bytes + cfg.storage.nvme_bytes),
    )
    # The receive-side rate answers `cluster_grant` before this node is seen: the others start
    # sending the moment Serf publishes it, before start() returns (a refused grant sends nothing)
    agent.cluster_receiver = ReceiveLimiter(
        c.rebalance_receive_bytes_per_s or c.rebalance_bytes_per_s
    )
    m.start()

    def tenants() -> dict[str, tuple[str, int]]:
        # no token: tokens never leave this node; peers are reached over the cluster channel.
        # list(): one C-level copy under the GIL; tenants change on the event loop (etcd)
        return {name: ("", t.replicas or c.replicas) for name, t in list(cfg.tenants.items())}

    m.rebalancer = Rebalancer(
        engine=agent.engine, node=m.node, placement=lambda: m.placement, tenants=tenants,
        bytes_per_s=c.rebalance_bytes_per_s, peer_auth=agent.peer_auth,
        interval_s=c.anti_entropy_interval_s,
        # killed or crashed (its DRAM tier gone): fetch back what it first-owns. Not after a
        # first start: a new member would pull what a join's hand-off sends it, outside its
        # receive grants (a replaced disk is repaired by the view change its absence makes)
        pull=agent.engine.recovery_report.previous_stop == "unclean",
    )  # fmt: skip
    m.rebalancer.start()
    m.reach = Reachability(m.node, lambda: m.view()["members"])
    m.reach.start()
    return m


def agent_cut_off(agent: Any) -> bool:
    """This node reaches no majority of the cluster (dpu_agent.cluster._reach): it refuses
    writes until it does."""
    m: Membership | None = agent.cluster
    return m is not None and m.reach is not None and bool(m.reach.cut_off)


def agent_cluster_view(agent: Any, tenant: str) -> dict[str, Any]:
    """`members` extras: epoch, serving count, and the session tenant's replica count."""
    m: Membership | None = agent.cluster
    if m is None:
        return {}
    replicas = _replicas(agent, tenant)
    view = m.view()
    _history(agent).remember(view["members"], view["epoch"])  # a later `since` is against it
    rebalance = m.rebalancer.progress.as_dict() if m.rebalancer is not None else {}
    reach = m.reach.as_dict() if m.reach is not None else {}
    return {"epoch": view["epoch"], "serving": view["serving"], "replicas": replicas,
            "node": m.node, "rebalance": rebalance, "reach": reach}  # fmt: skip


def agent_members_since(agent: Any, tenant: str, since: int) -> dict[str, Any] | None:
    """`members` with `since` (the client's epoch): unchanged, or what changed since that
    epoch; None when not in a cluster or that epoch is not remembered (the whole list)."""
    m: Membership | None = agent.cluster
    if m is None:
        return None
    view = m.view()
    delta = _history(agent).delta(view["members"], view["epoch"], since)
    if delta is None:
        return None
    t = agent.cfg.tenants.get(tenant)
    replicas = (t.replicas if t is not None and t.replicas else 0) or agent.cfg.cluster.replicas
    return {**delta, "epoch": view["epoch"], "since": since, "serving": view["serving"],
            "replicas": replicas, "node": m.node}  # fmt: skip


def _history(agent: Any) -> ViewHistory:
    h = getattr(agent, "_cluster_views", None)
    if h is None:
        h = agent._cluster_views = ViewHistory()
    return h


def _replicas(agent: Any, tenant: str) -> int:
    cfg = agent.cfg
    t = cfg.tenants.get(tenant)
    return (t.replicas if t is not None and t.replicas else 0) or cfg.cluster.replicas


def agent_cluster_op(agent: Any, tenant: str, op: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Agent-to-agent ops of the rebalancer: `cluster_grant` (the receive-side rate),
    `cluster_digest` (anti-entropy), `cluster_hot` (which copies beyond R are still hot).
    ValueError outside a cluster."""
    if op == "cluster_grant":  # answered from the moment Serf may publish this node
        receiver: ReceiveLimiter | None = agent.cluster_receiver
        if receiver is None:
            raise ValueError(f"{op}: this agent is not in a cluster")
        nbytes: Any = fields.get("bytes")
        problem = grant_bytes_problem(nbytes)  # the wire's own check (kvproto.control)
        if problem:
            raise ValueError(f"{op}: bytes must be {problem}")
        return {"wait_s": receiver.grant(nbytes)}
    m: Membership | None = agent.cluster
    if m is None or m.rebalancer is None:
        raise ValueError(f"{op}: this agent is not in a cluster")
    r: Rebalancer = m.rebalancer
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
