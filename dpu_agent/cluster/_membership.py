"""The agent's membership: its Serf agent, the tags it publishes, and the member list it follows.

Membership is state, not events: the current view is always `members` read from Serf, and the
RPC event stream (member-join/leave/failed/update/reap) only says "look again"; a periodic
re-read (REFRESH_INTERVAL) heals anything a stream missed. Serf coalesces and delays member
events and can show a graceful leave as `failed` for a while, so `failed` and `left` are
treated alike: not a member. Only `serving` members own keys (kvproto.placement).

Tags (Serf caps them at 512 bytes a node): ``ctl`` control URL, ``nvme`` NVMe/TCP host:port,
``cap`` capacity bytes, ``zone``, ``state`` (joining, serving, leaving), ``kv`` (protocol
version: other Serf members without it are not ours).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dpu_agent.cluster._serf_client import SerfClient, SerfUnreachable
from dpu_agent.cluster._serf_process import SerfProcess
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from kvproto.placement import NODE_STATES, Node, Placement
from kvproto.serf import Member, MemberEvent, ProtocolError, SerfError

__all__ = ["MEMBER_EVENTS_FILTER", "Membership", "MembershipOptions", "node_of"]

log = get_logger("dpu_agent.cluster")

MEMBER_EVENTS_FILTER = "member-join,member-leave,member-failed,member-update,member-reap"
KV_TAG_VERSION = "1"
STREAM_RETRY_S = 1.0  # after the Serf agent is lost, try the stream again this often

SERVING = Gauge("kvtier_cluster_serving_members", "Members that own keys in this agent's view.",
                registry=REGISTRY)  # fmt: skip
MEMBERS_FAILED = Gauge("kvtier_cluster_failed_members",
                       "Members Serf shows failed or left (treated alike).",
                       registry=REGISTRY)  # fmt: skip
VIEW_CHANGES = Counter("kvtier_cluster_view_changes", "Membership epoch changes seen.",
                       registry=REGISTRY)  # fmt: skip


class MembershipOptions:
    """What [cluster] in the config says (dpu_agent.config.ClusterSection), plus where to log."""

    def __init__(self, section: Any, data_dir: Path) -> None:
        self.serf_bin: str = section.serf_bin
        self.serf_start: bool = section.serf_start
        self.serf_bind: str = section.serf_bind
        self.serf_rpc: str = section.serf_rpc
        auth = Path(section.rpc_auth_file).expanduser() if section.rpc_auth_file else None
        if auth is not None and not auth.is_absolute():
            auth = data_dir / auth
        self.auth_key: str = auth.read_text().strip() if auth is not None else ""
        self.join = [s.strip() for s in section.join.split(",") if s.strip()]
        self.zone: str = section.zone
        self.replicas: int = section.replicas
        self.refresh_interval_s: float = section.refresh_interval_s
        self.profile: str = section.serf_profile
        self.log_path = data_dir / "serf.log"


def node_of(m: Member) -> Node | None:
    """The placement node a Serf member stands for; None for non-members (other Serf users,
    failed or left members, malformed tags)."""
    t = m.tags
    if t.get("kv") != KV_TAG_VERSION or m.status != "alive":
        return None
    state = t.get("state", "")
    try:
        cap = int(t.get("cap", "1"))
    except ValueError:
        return None
    if state not in NODE_STATES or cap <= 0:
        return None
    return Node(name=m.name, control=t.get("ctl", ""), nvme=t.get("nvme", ""),
                capacity_bytes=cap, zone=t.get("zone", ""), state=state)  # fmt: skip


class Membership:
    """Start with `start()` (blocking: run it in a thread from asyncio); `placement` is the
    current view; `on_change(placement)` runs after each view change (in the stream thread)."""

    def __init__(
        self,
        opts: MembershipOptions,
        *,
        node: str,
        control: str,
        nvme: str,
        capacity_bytes: int,
        on_change: Callable[[Placement], None] | None = None,
    ) -> None:
        self.opts = opts
        self.node = node
        self.tags = {
            "kv": KV_TAG_VERSION, "ctl": control, "nvme": nvme, "cap": str(capacity_bytes),
            "zone": opts.zone, "state": "joining",
        }  # fmt: skip
        self.serf: SerfProcess | None = None
        self._client: SerfClient | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_change = on_change
        self.members: list[Member] = []
        self.placement = Placement([])
        self.rebalancer: Any = None  # dpu_agent.cluster.Rebalancer, set by start_membership
        self.changes = 0  # view changes seen (epoch changes)
        self.last_change_s = 0.0

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        o = self.opts
        if o.serf_start:
            self.serf = SerfProcess(
                self.node, bind=o.serf_bind, rpc_addr=o.serf_rpc, tags=self.tags, join=o.join,
                auth_key=o.auth_key, profile=o.profile, serf_bin=o.serf_bin,
                log_path=o.log_path,
            )  # fmt: skip
            self._client = self.serf.wait_ready()
        else:  # an operator-run Serf agent: publish our tags on it, join the seeds
            self._client = SerfClient(o.serf_rpc, auth_key=o.auth_key)
            self._client.tags(self.tags)
            if o.join:
                with contextlib.suppress(SerfError):  # a dead seed: others may answer later
                    self._client.join(o.join)
        self.set_state("serving")
        self._thread = threading.Thread(target=self._follow, name="cluster-members", daemon=True)
        self._thread.start()
        log.info("cluster_started", node=self.node, serf_rpc=o.serf_rpc, epoch=self.epoch,
                 members=len(self.placement.nodes))  # fmt: skip

    def stop(self, *, leave: bool = True) -> None:
        """Stop following; leave the cluster gracefully (our own Serf child leaves and exits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.rebalancer is not None:
            self.rebalancer.stop()
        if self._client is not None:
            if leave and self.serf is None:
                with contextlib.suppress(SerfError, SerfUnreachable, TimeoutError):
                    self._client.tags({"state": "leaving"})
            self._client.close()
        if self.serf is not None:
            if leave:
                self.serf.stop()
            else:
                self.serf.kill()

    # --- state ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.placement.epoch

    def set_state(self, state: str) -> None:
        assert state in NODE_STATES, state
        assert self._client is not None, "start() first"
        self.tags["state"] = state
        with self._lock:
            self._client.tags({"state": state})
        self.refresh()

    def join(self, addrs: list[str]) -> int:
        assert self._client is not None, "start() first"
        with self._lock:
            n = self._client.join(addrs)
        self.refresh()
        return n

    def refresh(self) -> bool:
        """Read the member list again; True when the view (epoch) changed."""
        assert self._client is not None
        with self._lock:
            members = self._client.members()
        nodes = [n for n in map(node_of, members) if n is not None]
        placement = Placement(nodes)
        changed = placement.epoch != self.placement.epoch
        self.members = members
        self.placement = placement
        SERVING.set(len(placement.serving))
        MEMBERS_FAILED.set(sum(m.status in ("failed", "left") for m in members))
        if changed:
            VIEW_CHANGES.inc()
            self.changes += 1
            self.last_change_s = time.time()
            log.info("cluster_view", epoch=placement.epoch, serving=len(placement.serving),
                     members=[n.name for n in placement.nodes])  # fmt: skip
            if self._on_change is not None:
                self._on_change(placement)
            if self.rebalancer is not None:
                self.rebalancer.trigger()
        return changed

    def _follow(self) -> None:
        """Events say "look again"; every refresh_interval_s look again anyway."""
        while not self._stop.is_set():
            try:
                with SerfClient(self.opts.serf_rpc, auth_key=self.opts.auth_key) as events:
                    events.stream(MEMBER_EVENTS_FILTER)
                    self.refresh()  # anything between our last read and the stream's start
                    while not self._stop.is_set():
                        rec = events.next_record(self.opts.refresh_interval_s)
                        if rec is None or isinstance(rec, MemberEvent):
                            self.refresh()
            except (SerfUnreachable, SerfError, ProtocolError, TimeoutError) as e:
                if self._stop.is_set():
                    return
                log.warning("cluster_serf_lost", error=str(e), retry_s=STREAM_RETRY_S)
                self._stop.wait(STREAM_RETRY_S)

    # --- what the control plane answers ----------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """Every Serf member we know (with Serf's status), the epoch and the serving count."""
        rows = []
        for m in sorted(self.members, key=lambda m: m.name):
            t: Mapping[str, str] = m.tags
            if t.get("kv") != KV_TAG_VERSION:
                continue
            rows.append({
                "name": m.name, "status": m.status, "state": t.get("state", ""),
                "control": t.get("ctl", ""), "nvme": t.get("nvme", ""),
                "capacity_bytes": int(t.get("cap", "0") or 0), "zone": t.get("zone", ""),
                "serf": f"{m.addr}:{m.port}",
                # answers reads for what it holds: serving, or leaving and still alive (a
                # draining node keeps its copies until it is gone; clients read it last)
                "reads": m.status == "alive" and t.get("state") in ("serving", "leaving"),
            })  # fmt: skip
        return {"members": rows, "epoch": self.epoch, "serving": len(self.placement.serving)}
