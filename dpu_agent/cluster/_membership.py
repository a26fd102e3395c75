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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpu_agent.cluster._peer import refuse
from dpu_agent.cluster._serf_client import SerfClient, SerfUnreachable
from dpu_agent.cluster._serf_process import SerfProcess, name_conflict_in
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from kvproto.peer_auth import AUTH_TAG, member_tag, verify_member_tag
from kvproto.placement import NODE_STATES, Node, Placement
from kvproto.serf import Member, MemberEvent, ProtocolError, SerfError

__all__ = [
    "CAPACITY_BYTES_MAX",
    "MEMBER_EVENTS_FILTER",
    "Membership",
    "MembershipOptions",
    "check_member",
    "node_of",
]

log = get_logger("dpu_agent.cluster")

MEMBER_EVENTS_FILTER = "member-join,member-leave,member-failed,member-update,member-reap"
KV_TAG_VERSION = "1"
STREAM_RETRY_S = 1.0  # after the Serf agent is lost, try the stream again this often
# A member's published capacity weighs its share of keys. 1 PiB is far above any DPU's tiers
# (DRAM plus a few NVMe drives: tens of TB), so no honest node is cut, while a forged
# 2^63 could not outweigh a thousand real nodes by more than this bound allows.
CAPACITY_BYTES_MAX = 1 << 50
ZONE_CHARS_MAX = 64  # rack or row names
NAME_CHARS_MAX = 128  # node names (host names are at most 64; room for a suffix)
PORT_MAX = 65535
# Refusals remembered so each is logged and counted once (per member, reason and tags): past
# this many the set starts over (a flood of fake members is logged again, rate-limited).
REFUSALS_REMEMBERED_MAX = 4096
# Members whose tags were checked (the HMAC verified once per name and tag set, not again at
# every `members` answer): a cluster's members plus churn; past this the cache starts over.
CHECKED_MEMBERS_MAX = 4096

SERVING = Gauge("kvtier_cluster_serving_members", "Members that own keys in this agent's view.",
                registry=REGISTRY)  # fmt: skip
MEMBERS_FAILED = Gauge("kvtier_cluster_failed_members",
                       "Members Serf shows failed or left (treated alike).",
                       registry=REGISTRY)  # fmt: skip
VIEW_CHANGES = Counter("kvtier_cluster_view_changes", "Membership epoch changes seen.",
                       registry=REGISTRY)  # fmt: skip


class MembershipOptions:
    """What [cluster] in the config says (dpu_agent.config.ClusterSection), the secrets
    AgentConfig.prepare() loaded, and where to log."""

    def __init__(self, cfg: Any) -> None:
        section = cfg.cluster
        self.serf_bin: str = section.serf_bin
        self.serf_start: bool = section.serf_start
        self.serf_bind: str = section.serf_bind
        self.serf_rpc: str = section.serf_rpc
        self.auth_key: str = cfg.serf_rpc_key
        self.keyring_file: Path = cfg.path(section.keyring_file)
        self.peer_keys: tuple[bytes, ...] = cfg.peer_keys
        self.join = [s.strip() for s in section.join.split(",") if s.strip()]
        self.zone: str = section.zone
        self.replicas: int = section.replicas
        self.refresh_interval_s: float = section.refresh_interval_s
        self.profile: str = section.serf_profile
        self.log_path = cfg.data_dir / "serf.log"


def _hostport(v: str) -> bool:
    host, _, port = v.rpartition(":")
    ok = port.isascii() and port.isdigit() and len(port) <= 5  # "²".isdigit() is True
    return bool(host.strip("[]")) and ok and 0 < int(port) <= PORT_MAX


def _bad_tag(t: Mapping[str, str]) -> str:
    """Why these kv tags cannot describe a member ("" when they can)."""
    if t.get("state", "") not in NODE_STATES:
        return f"state={t.get('state', '')!r:.40}"
    cap = t.get("cap", "")
    if not (cap.isascii() and cap.isdigit() and len(cap) <= 20
            and 0 < int(cap) <= CAPACITY_BYTES_MAX):  # fmt: skip
        return f"cap={cap!r:.40} (1..{CAPACITY_BYTES_MAX})"
    ctl = t.get("ctl", "")
    scheme, sep, rest = ctl.partition("://")
    if scheme not in ("tcp", "tls") or not sep or not _hostport(rest):
        return f"ctl={ctl!r:.80} (tcp://host:port or tls://host:port)"
    nvme = t.get("nvme", "")
    if nvme and not _hostport(nvme):
        return f"nvme={nvme!r:.80} (host:port)"
    if len(t.get("zone", "")) > ZONE_CHARS_MAX:
        return f"zone of {len(t.get('zone', ''))} characters (at most {ZONE_CHARS_MAX})"
    return ""


def check_member(m: Member, keys: Sequence[bytes]) -> Node | str:
    """The placement node a kv member stands for (whatever its Serf status), or why it is
    refused: malformed tags, or an ``auth`` tag that does not verify with the cluster `keys`
    (it cannot prove it is one of ours). Never raises, whatever the tags hold."""
    t = m.tags
    bad = _bad_tag(t)
    if bad:
        return f"bad_tag: {bad}"
    if not 0 < len(m.name) <= NAME_CHARS_MAX or not m.name.isprintable():
        return f"bad_tag: name {m.name!r:.80}"
    if not verify_member_tag(keys, m.name, t):
        return "member_tag: its auth tag does not verify with the cluster key"
    return Node(name=m.name, control=t["ctl"], nvme=t.get("nvme", ""),
                capacity_bytes=int(t["cap"]), zone=t.get("zone", ""), state=t["state"])  # fmt: skip


def node_of(m: Member, keys: Sequence[bytes]) -> Node | None:
    """The placement node of a member that owns keys: ours (``kv`` tag), alive in Serf (left
    and failed members never own keys), well-formed tags and a verified ``auth`` tag."""
    if m.tags.get("kv") != KV_TAG_VERSION or m.status != "alive":
        return None
    node = check_member(m, keys)
    return node if isinstance(node, Node) else None


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
            "kv": KV_TAG_VERSION, "ctl": control, "nvme": nvme,
            "cap": str(min(capacity_bytes, CAPACITY_BYTES_MAX)), "zone": opts.zone,
        }  # fmt: skip
        # proves to the others that this member holds the cluster key (kvproto.peer_auth)
        self.tags[AUTH_TAG] = member_tag(opts.peer_keys[0], node, self.tags)
        self.tags["state"] = "joining"
        self._refused: set[tuple[str, str, int]] = set()  # logged once: REFUSALS_REMEMBERED_MAX
        self._checked: dict[tuple[str, tuple[tuple[str, str], ...]], Node | str] = {}
        self.serf: SerfProcess | None = None
        self._client: SerfClient | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_change = on_change
        self.members: list[Member] = []
        self.placement = Placement([])
        self.rebalancer: Any = None  # dpu_agent.cluster.Rebalancer, set by start_membership
        self.reach: Any = None  # dpu_agent.cluster._reach.Reachability, set by start_membership
        self.changes = 0  # view changes seen (epoch changes)
        self.last_change_s = 0.0
        self._conflict_logged = False  # cluster_node_name_conflict said

    # --- lifecycle -----------------------------------------------------------------------
    def _spawn(self, join: Sequence[str]) -> SerfClient:
        o = self.opts
        self.serf = SerfProcess(
            self.node, bind=o.serf_bind, rpc_addr=o.serf_rpc, tags=self.tags, join=join,
            auth_key=o.auth_key, profile=o.profile, serf_bin=o.serf_bin,
            log_path=o.log_path, keyring_file=o.keyring_file,
        )  # fmt: skip
        return self.serf.wait_ready()

    def start(self) -> None:
        o = self.opts
        if o.serf_start:
            self._client = self._spawn(o.join)
        else:  # an operator-run Serf agent: publish our tags on it, join the seeds
            self._client = SerfClient(o.serf_rpc, auth_key=o.auth_key)
            self._client.tags(self.tags)
        if not self._client.encrypted():
            self.stop(leave=False)
            raise RuntimeError(
                f"Serf at {o.serf_rpc} does not encrypt gossip: anyone who reaches its port could "
                "join. Start it with -keyring-file (docs/CLUSTER.md, Keys)"
            )
        if self.serf is None and o.join:
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
        if self.reach is not None:
            self.reach.stop()
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
        nodes = [n for n in (self._owner(m) for m in members) if n is not None]
        for m in members:  # `dpuctl cluster leave|join` set our state through Serf directly
            if m.name == self.node and m.tags.get("state") in NODE_STATES:
                self.tags["state"] = m.tags["state"]
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

    def _owner(self, m: Member) -> Node | None:
        """`m`'s node when it owns keys; refusals of kv members are logged and counted once."""
        if m.tags.get("kv") != KV_TAG_VERSION:
            return None  # another Serf user's node: not ours, not refused
        node = self._check(m)
        if isinstance(node, str):
            self._refusal(m, node)
            return None
        return node if m.status == "alive" else None

    def _check(self, m: Member) -> Node | str:
        """check_member, once per member name and tag set (tags change rarely, views often)."""
        key = (m.name, tuple(sorted(m.tags.items())))
        got = self._checked.get(key)
        if got is None:
            if len(self._checked) >= CHECKED_MEMBERS_MAX:
                self._checked.clear()
            got = self._checked[key] = check_member(m, self.opts.peer_keys)
        return got

    def _refusal(self, m: Member, why: str) -> None:
        seen = (m.name, why, hash(tuple(sorted(m.tags.items()))))
        if seen in self._refused:
            return
        if len(self._refused) >= REFUSALS_REMEMBERED_MAX:
            self._refused.clear()
        self._refused.add(seen)
        refuse(why.partition(":")[0], member=m.name[:128], addr=f"{m.addr}:{m.port}",
               status=m.status, why=why)  # fmt: skip

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
                if not self._stop.is_set():
                    self._reconnect()

    def _reconnect(self) -> None:
        """Serf is back to talk to after it was lost. Serf exits after a graceful leave
        (`dpuctl cluster leave`): our own child is started again, alone and still `leaving`
        (it owns nothing and joins nobody) so that `dpuctl cluster join` can bring the node
        back without an agent restart; a child that crashed starts again with the seeds and
        the state it had. An operator-run Serf that came back gets our tags again."""
        with self._lock:
            left = self.tags["state"] == "leaving"
            try:
                if self.serf is not None:
                    if self.serf.alive:
                        return  # only the stream broke: the next loop opens another
                    self.serf.kill()  # reaped, its config dir removed
                    self._name_conflict()
                    client = self._spawn([] if left else self.opts.join)
                else:
                    client = SerfClient(self.opts.serf_rpc, auth_key=self.opts.auth_key)
                    client.tags(self.tags)
            except (RuntimeError, OSError, SerfError, ProtocolError, TimeoutError) as e:
                log.warning("cluster_serf_restart_failed", error=str(e))
                return
            old, self._client = self._client, client
            if old is not None:
                old.close()
        log.info("cluster_serf_restarted", node=self.node, left=left,
                 own=self.serf is not None)  # fmt: skip

    def _name_conflict(self) -> None:
        """Serf quits when another member has our node name and wins Serf's vote: said once
        (it restarted every few seconds for good, and nothing named the cause)."""
        other = name_conflict_in(self.opts.log_path)
        if other is not None and not self._conflict_logged:
            self._conflict_logged = True
            fix = ("another agent runs with this [agent] node_name (a copied config, a node "
                   "restored elsewhere): give each agent its own name; this one keeps "
                   "restarting Serf and stays out of the cluster meanwhile")  # fmt: skip
            log.error("cluster_node_name_conflict", node=self.node, other=other, fix=fix)

    # --- what the control plane answers ----------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """Every kv member Serf knows (with Serf's status; a member refused for its tags or
        its proof shows as ``refused`` with the reason), the epoch and the serving count."""
        rows: list[dict[str, Any]] = []
        for m in sorted(self.members, key=lambda m: m.name):
            if m.tags.get("kv") != KV_TAG_VERSION:
                continue
            node = self._check(m)
            if isinstance(node, str):
                rows.append({"name": m.name[:NAME_CHARS_MAX], "status": "refused",
                             "reason": node, "serf": f"{m.addr}:{m.port}"})  # fmt: skip
                continue
            # answers reads for what it holds: serving, or leaving and still alive (a draining
            # node keeps its copies until it is gone; clients read it last)
            reads = m.status == "alive" and node.state in ("serving", "leaving")
            rows.append({**node.as_dict(), "status": m.status, "serf": f"{m.addr}:{m.port}",
                         "reads": reads})  # fmt: skip
        return {"members": rows, "epoch": self.epoch, "serving": len(self.placement.serving)}
