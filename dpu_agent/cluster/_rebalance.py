"""Rebalancing: after a membership change, hand each chunk this node holds but no longer owns
to its owners, and (as a chunk's first owner) copy it to owners that lack it.

A pass walks the tenant's keys in batches, computes owners with the current placement, reads
each chunk to move through the engine (checksum verified: a corrupt chunk is never sent),
writes it to the owner through the ordinary data plane (a single-node KVClient: reserve,
NVMe/TCP write, commit with the checksum; the receiver encrypts with its own keys), and
deletes the local copy once every owner holds it. Passes are idempotent: a pass stopped by
a crash, a restart or a newer membership change leaves the remaining chunks where they are
and the next pass (at start, on every change) picks them up: resumable without a log. A holder
that is still an owner copies the chunk to owners that lack it when the chunk's owner set
changed since the last settled pass (a new owner joined, one failed); right after start, with
no settled view, only the first owner does.
Throttled to `bytes_per_s` (token bucket); progress in metrics and `dpuctl cluster status`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dpu_agent.cluster._peer import PeerAuth, open_peer
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from host_shim.client import NodeClient
from kvproto.placement import Node, Placement

__all__ = ["REBALANCE_BATCH_KEYS", "RebalanceProgress", "Rebalancer", "tenant_keys"]

log = get_logger("dpu_agent.cluster")

REBALANCE_BATCH_KEYS = 256  # keys placed per numpy pass (and between checks for a new epoch)
PEER_CLIENTS_MAX = 1024  # one client per (tenant, owner) at most; a 1,024-node cluster

MOVED_BYTES = Counter("kvtier_cluster_rebalance_bytes", "Bytes handed to new owners.",
                      registry=REGISTRY)  # fmt: skip
MOVED_CHUNKS = Counter("kvtier_cluster_rebalance_chunks", "Chunks handed to new owners.",
                       registry=REGISTRY)  # fmt: skip
PENDING = Gauge("kvtier_cluster_rebalance_pending_chunks",
                "Chunks held here that other owners should hold (last pass).",
                registry=REGISTRY)  # fmt: skip


@dataclass(slots=True)
class RebalanceProgress:
    running: bool = False
    passes: int = 0
    epoch: int = 0  # the placement epoch of the current or last pass
    scanned: int = 0  # keys looked at in the current or last pass
    moved_chunks: int = 0  # chunks handed off (all passes)
    moved_bytes: int = 0
    copied_chunks: int = 0  # extra replicas written as a first owner (all passes)
    pending: int = 0  # chunks still to hand off when the last pass ended (0: drained)
    failed: int = 0  # chunks an owner did not take in the last pass (retried next pass)
    last_pass_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tenant_keys(engine: Any, tenant: str) -> list[bytes]:
    """Every live key of `tenant` (a snapshot; the engine keeps serving meanwhile)."""
    with engine._lock:
        ts = engine._tenant(tenant)
        idx = engine._index
        rows = idx.live_rows()
        rows = rows[idx.cols["tenant"][rows] == ts.tenant_id]
        words = np.empty((len(rows), 2), dtype="<u8")
        words[:, 0] = idx.cols["k0"][rows]
        words[:, 1] = idx.cols["k1"][rows]
    blob = words.tobytes()
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


class Rebalancer:
    """One worker thread; `trigger()` after each membership change."""

    def __init__(
        self,
        *,
        engine: Any,
        node: str,
        placement: Callable[[], Placement],
        tenants: Callable[[], dict[str, tuple[str, int]]],  # tenant -> (token, replicas)
        bytes_per_s: float,
        peer_auth: PeerAuth | None,
    ) -> None:
        assert bytes_per_s > 0, bytes_per_s
        self._peer_auth = peer_auth  # None: no cluster key, so no peer is ever contacted
        self.engine, self.node = engine, node
        self._placement, self._tenants = placement, tenants
        self.bytes_per_s = bytes_per_s
        self.progress = RebalanceProgress()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._clients: dict[tuple[str, str], NodeClient] = {}
        self._thread = threading.Thread(target=self._loop, name="cluster-rebalance", daemon=True)
        self._budget = 0.0
        self._budget_at = time.monotonic()
        # The view of the last pass that ended with nothing pending or failed: a chunk whose
        # owners were all owners then is where it belongs; only changed owner sets are checked
        self._settled: Placement | None = None

    def start(self) -> None:
        self._thread.start()
        self.trigger()

    def trigger(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        for c in self._clients.values():
            c.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_pass()
            except Exception:  # a failing pass must not stop the agent; the next one retries
                log.exception("cluster_rebalance_failed")

    def run_pass(self) -> RebalanceProgress:
        p = self.progress
        placement = self._placement()
        p.running, p.epoch, p.scanned, p.pending, p.failed = True, placement.epoch, 0, 0, 0
        t0 = time.monotonic()
        settled = self._settled
        try:
            for tenant, (token, replicas) in sorted(self._tenants().items()):
                keys = tenant_keys(self.engine, tenant)
                for i in range(0, len(keys), REBALANCE_BATCH_KEYS):
                    if self._stop.is_set() or self._placement().epoch != placement.epoch:
                        p.pending += len(keys) - i  # a newer view: the next pass goes on
                        self._wake.set()
                        return p
                    batch = keys[i : i + REBALANCE_BATCH_KEYS]
                    before = settled.owners_batch(batch, replicas) if settled else None
                    self._batch(tenant, token, batch, placement.owners_batch(batch, replicas),
                                before)  # fmt: skip
            if not p.pending and not p.failed:
                self._settled = placement
        finally:
            p.running = False
            p.passes += 1
            p.last_pass_s = round(time.monotonic() - t0, 3)
            PENDING.set(p.pending)
            if p.moved_chunks or p.failed or p.pending:
                log.info("cluster_rebalance_pass", **p.as_dict())
        return p

    def _batch(
        self,
        tenant: str,
        token: str,
        keys: list[bytes],
        owners: list[list[Node]],
        before: list[list[Node]] | None,
    ) -> None:
        p = self.progress
        for k, (key, nodes) in enumerate(zip(keys, owners, strict=True)):
            p.scanned += 1
            names = [n.name for n in nodes]
            mine = self.node in names
            targets = [n for n in nodes if n.name != self.node]
            if not targets:
                continue
            if mine and before is None and names[0] != self.node:
                continue  # no settled view (just started): the first owner re-replicates
            if mine and before is not None and set(names) <= {n.name for n in before[k]}:
                continue  # the same owners as in the settled view: they hold it
            if mine and not self._missing_anywhere(tenant, token, key, targets):
                continue
            data = self.engine.get_chunk(tenant, key)  # checksum verified; None: gone or bad
            if data is None:
                continue
            took = [self._give(tenant, token, n, key, data) for n in targets]
            if all(took):
                if not mine:
                    self.engine.delete(tenant, key)
                    p.moved_chunks += 1
                    p.moved_bytes += len(data)
                    MOVED_CHUNKS.inc()
                    MOVED_BYTES.inc(len(data))
                else:
                    p.copied_chunks += 1
            else:
                p.failed += 1
                p.pending += 0 if mine else 1

    def _missing_anywhere(self, tenant: str, token: str, key: bytes, nodes: list[Node]) -> bool:
        return any(self._peer(tenant, token, n).lookup_keys([key]) == 0 for n in nodes)

    def _give(self, tenant: str, token: str, node: Node, key: bytes, data: bytes) -> bool:
        self._throttle(len(data))
        c = self._peer(tenant, token, node)
        return c.put_keys([key], [data], [None], chunk_bytes=len(data)) == 1

    def _peer(self, tenant: str, token: str, node: Node) -> NodeClient:
        """A peer connection (cluster/_peer.py): the tenant by name, never its token; a peer
        that fails the handshake takes nothing, so nothing is deleted on its word."""
        assert self._peer_auth is not None, "a rebalancer without the cluster key"
        c = self._clients.get((tenant, node.name))
        if c is None or c._channel.url != node.control:
            if len(self._clients) >= PEER_CLIENTS_MAX:
                for old in self._clients.values():
                    old.close()
                self._clients.clear()
            c = open_peer(node, tenant, self._peer_auth)
            self._clients[(tenant, node.name)] = c
        return c

    def _throttle(self, nbytes: int) -> None:
        """Token bucket: at most bytes_per_s on average, bursts of one second's worth."""
        now = time.monotonic()
        self._budget = min(
            self.bytes_per_s, self._budget + (now - self._budget_at) * self.bytes_per_s
        )
        self._budget_at = now
        self._budget -= nbytes
        if self._budget < 0:
            self._stop.wait(-self._budget / self.bytes_per_s)
