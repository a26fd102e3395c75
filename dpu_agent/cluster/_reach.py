"""Is this node cut off from most of the cluster? A direct check, not Serf's view.

Serf's failure detector on a node whose own link is down or silently dropping marks the
others failed slowly and one by one (tens of seconds), or not at all, so the node would go
on serving with a stale view. Every REACH_INTERVAL_S this agent opens a TCP connection to
each known member's control port (connect, then close: nothing is sent, so nothing is
authenticated or logged there) with REACH_TIMEOUT_S. Known members are those Serf lists as
alive or failed (a graceful leave is not counted). When this node (counted as reachable)
reaches no strict majority of the known members, it is cut off: `members`/`dpuctl cluster
status` say so (`reach.cut_off`), the gauge kvtier_cluster_cut_off is 1, the change is
logged, and the agent refuses new writes (reserve answers `unavailable`) until it reaches a
majority again; reads go on (a key's chunk is the same bytes wherever it is read). This is
Redis Cluster's rule for a minority primary after the node timeout: a split never takes
writes on both sides.

The same check sees a split that gossip alone keeps: a member Serf lists as failed whose
control port answers. Serf retries a failed member every 30 s, so after a healed partition
that lasts seconds; past GOSSIP_SPLIT_S it is a member whose gossip cannot reach this node or
this node's it (a gossip key it lacks, a firewall on the gossip port, its Serf dead): the two
serve different views for good. `reach.gossip_split` names them (at most 16), the gauge
kvtier_cluster_gossip_split_members counts them, and `cluster_gossip_split` is logged when
the set changes. Nothing else changes: both sides reach a majority of what they know.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Gauge

__all__ = [
    "GOSSIP_SPLIT_S",
    "REACH_INTERVAL_S",
    "REACH_TIMEOUT_S",
    "Reachability",
    "majority_reached",
]

log = get_logger("dpu_agent.cluster")

REACH_INTERVAL_S = 1.0  # a cut-off node says so within about this plus REACH_TIMEOUT_S
# A TCP connect on a LAN answers in well under a millisecond; a member that does not answer
# in half a second is unreachable for the purpose of this check (clients use 250 ms).
REACH_TIMEOUT_S = 0.5
# Members connected to per check: a random sample beyond this (the majority is estimated
# from it), so a check costs the same at 1,024 members as at 32.
REACH_SAMPLE_MAX = 32
# Connects in flight at once: a check of REACH_SAMPLE_MAX silent members then takes at most
# 4 x REACH_TIMEOUT_S (2 s), and the agent runs no more than 8 threads for it.
REACH_THREADS_MAX = 8
# A failed member that answers on its control port for this long is split off by gossip:
# three of Serf's 30 s reconnect attempts did not bring it back.
GOSSIP_SPLIT_S = 90.0
SPLIT_NAMES_MAX = 16  # names in reach.gossip_split and its log line

CUT_OFF = Gauge("kvtier_cluster_cut_off",
                "1 while this node reaches no majority of the cluster (it refuses writes).",
                registry=REGISTRY)  # fmt: skip
REACHABLE = Gauge("kvtier_cluster_reachable_members",
                  "Members this node reached in its last check, itself included.",
                  registry=REGISTRY)  # fmt: skip
GOSSIP_SPLIT = Gauge("kvtier_cluster_gossip_split_members",
                     "Members Serf lists as failed whose control port has answered for over "
                     "GOSSIP_SPLIT_S: split off by gossip.", registry=REGISTRY)  # fmt: skip


def majority_reached(reached: int, known: int) -> bool:
    """`reached` of `known` members (this node included in both) is a strict majority."""
    return reached * 2 > known


def _reaches(url: str, timeout_s: float) -> bool:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    if not parts.hostname or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


class Reachability:
    """The check above in a thread; `cut_off` is its latest verdict."""

    def __init__(self, node: str, members: Callable[[], list[Mapping[str, Any]]]) -> None:
        self.node = node
        self._members = members
        self.cut_off = False
        self.reached = 1
        self.known = 1
        self.changed_at = time.time()
        self.checked_at = 0.0
        self._failed_answering: dict[str, float] = {}  # failed in Serf, port answers: since
        self.gossip_split: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(REACH_THREADS_MAX, thread_name_prefix="cluster-reach")
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cluster-reach", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REACH_TIMEOUT_S * 4 + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(REACH_INTERVAL_S):
            try:
                self.check()
            except Exception as e:  # the check must outlive a bad round
                log.warning("cluster_reach_failed", error=str(e))

    def check(self) -> bool:
        """One check; returns whether this node is cut off."""
        rows = [r for r in self._members()
                if r.get("name") != self.node and r.get("status") in ("alive", "failed")
                and r.get("control")]  # fmt: skip
        sample = random.sample(rows, min(len(rows), REACH_SAMPLE_MAX))
        ok = list(self._pool.map(lambda r: _reaches(str(r["control"]), REACH_TIMEOUT_S), sample))
        others = round(sum(ok) * len(rows) / len(sample)) if sample else 0
        self.reached, self.known = others + 1, len(rows) + 1
        cut = not majority_reached(self.reached, self.known)
        self.checked_at = time.time()
        if cut != self.cut_off:
            self.cut_off = cut
            self.changed_at = self.checked_at
            if cut:
                log.warning("cluster_cut_off", reached=self.reached, known=self.known,
                            unreachable=[str(r["name"]) for r, y in zip(sample, ok, strict=True)
                                         if not y][:16],
                            writes="refused until a majority is reachable")  # fmt: skip
            else:
                log.warning("cluster_reconnected", reached=self.reached, known=self.known)
        CUT_OFF.set(1 if cut else 0)
        REACHABLE.set(self.reached)
        self._split(rows, sample, ok)
        return cut

    def _split(
        self, rows: list[Mapping[str, Any]], sample: list[Mapping[str, Any]], ok: list[bool]
    ) -> None:
        """Members failed in Serf whose control port answered in every check for
        GOSSIP_SPLIT_S (module docstring). A member not in this check's sample keeps its
        entry; one no longer failed, or not answering, loses it."""
        failed = {str(r["name"]) for r in rows if r.get("status") == "failed"}
        since = self._failed_answering
        for name in [n for n in since if n not in failed]:
            del since[name]
        for r, answered in zip(sample, ok, strict=True):
            name = str(r["name"])
            if name not in failed or not answered:
                since.pop(name, None)
            else:
                since.setdefault(name, self.checked_at)
        split = sorted(n for n, t in since.items() if self.checked_at - t >= GOSSIP_SPLIT_S)
        if split != self.gossip_split:
            self.gossip_split = split
            if not split:
                log.warning("cluster_gossip_split_healed")
            else:
                log.warning("cluster_gossip_split", members=split[:SPLIT_NAMES_MAX],
                            count=len(split), seconds=GOSSIP_SPLIT_S,
                            hint="they answer on their control port but gossip does not "
                            "reach them: check the gossip key (dpuctl cluster keys list "
                            "on both sides) and the gossip port")  # fmt: skip
        GOSSIP_SPLIT.set(len(split))

    def as_dict(self) -> dict[str, Any]:
        return {
            "cut_off": self.cut_off, "reached": self.reached, "known": self.known,
            "since": round(self.changed_at, 3), "checked": round(self.checked_at, 3),
            "gossip_split": self.gossip_split[:SPLIT_NAMES_MAX],
        }  # fmt: skip
