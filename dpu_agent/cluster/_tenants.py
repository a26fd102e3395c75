"""Cluster-wide tenants: etcd is the source of truth (docs/CLUSTER.md, "Tenants").

One key per tenant, ``<prefix>tenants/<name>``, holding its token, quota, replicas and an
incarnation (random, new for each add: a remove and re-add of one name while a node was down is
seen as a different tenant, so that node erases the old one). `dpuctl tenants add|rotate|remove`
on any node writes there with a compare-and-swap; every agent follows the prefix with a watch
and reconciles (STYLE 21): desired = the records, live = its own tenants, plan = ordered steps,
apply on the agent's event loop. A tenant that is on a node but neither in etcd nor in the
node's config file is crypto-erased there, before the node serves it again.

A node serves etcd tenants only after one successful read of etcd since its start: a node that
was down during a removal erases the tenant before its token is accepted again. A node that
loses etcd later keeps serving the tenants it knows (a cache must not go dark with its
coordinator) and refuses tenant changes; it says so in logs and in
kvtier_cluster_tenant_source_up, and applies what it missed when etcd answers again.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dpu_agent.cluster._etcd import EtcdClient, EtcdError, EtcdUnreachable, EtcdWatch
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge
from kvproto.control import valid_tenant_name

__all__ = [
    "TENANT_CHANGES_APPLIED",
    "TENANT_TOKEN_BYTES",
    "TenantPlanStep",
    "TenantRecord",
    "TenantSource",
    "TenantSync",
    "plan_tenants",
    "tenant_source",
]

log = get_logger("dpu_agent.cluster.tenants")

TENANT_TOKEN_BYTES = 32  # as AgentConfig's generated tokens: 256 bits
TENANT_RECORD_BYTES_MAX = 4096  # a record is ~150 bytes; anything bigger is not ours
# A watch that sees nothing for this long ends and the state is read again: that read is also
# how a node notices that etcd is gone (a silent watch cannot tell).
WATCH_QUIET_S = 3.0
RETRY_S = 1.0  # between reads of an unreachable etcd: a change lands within a second of heal
APPLY_TIMEOUT_S = 60.0  # one reconcile on the loop: crypto-erase of a tenant is an unlink + fsync

SOURCE_UP = Gauge(
    "kvtier_cluster_tenant_source_up",
    "1 when the last read of the tenant source (etcd) succeeded, 0 while it is unreachable.",
    registry=REGISTRY,
)
TENANT_CHANGES_APPLIED = Counter(
    "kvtier_cluster_tenant_changes_applied",
    "Tenant changes from the tenant source applied on this node, by kind.",
    ["kind"],
    registry=REGISTRY,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantRecord:
    name: str
    token: str = field(repr=False)  # a secret: never in a log line or a traceback
    incarnation: str
    quota_bytes: int = 0
    replicas: int = 0
    mod_revision: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {
                "token": self.token,
                "incarnation": self.incarnation,
                "quota_bytes": self.quota_bytes,
                "replicas": self.replicas,
            }
        ).encode()

    @classmethod
    def decode(cls, name: str, raw: bytes, mod_revision: int) -> TenantRecord:
        """ValueError when the value is not a record this code wrote."""
        if len(raw) > TENANT_RECORD_BYTES_MAX:
            raise ValueError(f"record of {len(raw)} bytes")
        doc = json.loads(raw)
        token, inc = doc.get("token"), doc.get("incarnation")
        quota, replicas = doc.get("quota_bytes", 0), doc.get("replicas", 0)
        if not (isinstance(token, str) and token and isinstance(inc, str) and inc):
            raise ValueError("token and incarnation must be non-empty strings")
        if not (isinstance(quota, int) and quota >= 0 and isinstance(replicas, int)):
            raise ValueError("quota_bytes and replicas must be integers >= 0")
        return cls(name=name, token=token, incarnation=inc, quota_bytes=quota,
                   replicas=max(0, replicas), mod_revision=mod_revision)  # fmt: skip


class TenantSource:
    """The tenant records in etcd, under `prefix`."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix.rstrip("/") + "/tenants/"

    def snapshot(self) -> tuple[dict[str, TenantRecord], int]:
        """Every valid record and the revision read. A record that does not parse is skipped
        and logged: one bad value must not take every tenant away."""
        kvs, revision = self.client.range_prefix(self.prefix)
        out: dict[str, TenantRecord] = {}
        for kv in kvs:
            name = kv.key[len(self.prefix) :]
            try:
                if not valid_tenant_name(name):
                    raise ValueError("not a valid tenant name")
                out[name] = TenantRecord.decode(name, kv.value, kv.mod_revision)
            except ValueError as e:
                log.error("tenant_record_invalid", key=kv.key[:200], error=str(e)[:200])
        return out, revision

    def add(self, name: str, token: str, quota_bytes: int) -> TenantRecord:
        rec = TenantRecord(name=name, token=token, incarnation=secrets.token_hex(8),
                           quota_bytes=quota_bytes)  # fmt: skip
        if not self.client.create(self.prefix + name, rec.encode()):
            raise ValueError(
                f"tenant {name!r} exists in the cluster; its token is the one printed when it "
                "was added (dpuctl tenants rotate gives a new one)"
            )
        return rec

    def _current(self, name: str) -> TenantRecord:
        records, _ = self.snapshot()
        rec = records.get(name)
        if rec is None:
            raise LookupError(f"no tenant {name!r} in the cluster; see dpuctl tenants list")
        return rec

    def rotate(self, name: str, token: str) -> TenantRecord:
        old = self._current(name)
        rec = TenantRecord(name=name, token=token, incarnation=old.incarnation,
                           quota_bytes=old.quota_bytes, replicas=old.replicas)  # fmt: skip
        if not self.client.replace(self.prefix + name, rec.encode(), old.mod_revision):
            raise ValueError(f"tenant {name!r} changed while rotating; run the command again")
        return rec

    def remove(self, name: str) -> None:
        old = self._current(name)
        if not self.client.delete(self.prefix + name, old.mod_revision):
            raise ValueError(f"tenant {name!r} changed while removing; run the command again")


def tenant_source(cfg: Any, read_secret: Callable[[Path], str]) -> TenantSource | None:
    """The configured source ([cluster] etcd_endpoints), or None (tenants are per node)."""
    c = cfg.cluster
    if not c.etcd_endpoints:
        return None
    ctx: ssl.SSLContext | None = None
    if c.etcd_ca_file or c.etcd_cert_file:
        ca = str(cfg.path(c.etcd_ca_file)) if c.etcd_ca_file else None
        ctx = ssl.create_default_context(cafile=ca)
        if c.etcd_cert_file:
            key = cfg.path(c.etcd_key_file) if c.etcd_key_file else None
            ctx.load_cert_chain(cfg.path(c.etcd_cert_file), key)
    for url in c.etcd_endpoints.split(","):
        host = urlsplit(url.strip()).hostname or ""
        if url.strip().startswith("http://") and host not in ("127.0.0.1", "::1", "localhost"):
            why = "tenant tokens cross the network in clear: use https:// endpoints"
            log.warning("etcd_plaintext", endpoint=url.strip(), why=why)
    password = read_secret(cfg.path(c.etcd_password_file)) if c.etcd_password_file else ""
    client = EtcdClient(c.etcd_endpoints, user=c.etcd_user, password=password, ssl_context=ctx)
    return TenantSource(client, c.etcd_prefix)


# --- reconcile -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantPlanStep:
    kind: str  # "erase", "add", "token", "quota"
    name: str
    why: str
    record: TenantRecord | None = None


def plan_tenants(
    desired: Mapping[str, TenantRecord],
    *,
    static: set[str],
    known: Mapping[str, str],
    served: Mapping[str, tuple[str, int]],
    engine: set[str],
) -> list[TenantPlanStep]:
    """Steps that take this node from what it has to `desired` (pure).

    `static`: the config file's tenants (never touched here); `known`: the cluster tenants this
    node has held, name -> incarnation (kept on disk across restarts); `served`: those it serves
    now, name -> (token, quota_bytes); `engine`: every tenant with state on disk. Erasures come
    first, so a re-added name starts from nothing."""
    steps: list[TenantPlanStep] = []
    for name in sorted((engine | set(known) | set(served)) - static):
        rec = desired.get(name)
        if rec is None:
            steps.append(TenantPlanStep(kind="erase", name=name, why="not in the cluster"))
        elif name not in known:
            steps.append(TenantPlanStep(kind="erase", name=name, why="unknown incarnation"))
        elif known[name] != rec.incarnation:
            steps.append(TenantPlanStep(kind="erase", name=name, why="removed and re-added"))
    erased = {s.name for s in steps}
    for name, rec in sorted(desired.items()):
        if name in static:
            continue  # the config file wins on this node (the caller logs it)
        if name not in served or name in erased:
            steps.append(TenantPlanStep(kind="add", name=name, why="new", record=rec))
            continue
        token, quota_bytes = served[name]
        if token != rec.token:
            steps.append(TenantPlanStep(kind="token", name=name, why="rotated", record=rec))
        if quota_bytes != rec.quota_bytes:
            steps.append(TenantPlanStep(kind="quota", name=name, why="changed", record=rec))
    return steps


class TenantSync:
    """Follows the source in a thread and hands each snapshot to `apply` on the agent's loop.

    `apply(records)` is a coroutine function run on `loop`; it returns when the node matches."""

    def __init__(
        self,
        source: TenantSource,
        apply: Callable[[dict[str, TenantRecord]], Coroutine[Any, Any, None]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.source = source
        self._apply = apply
        self._loop = loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = False  # one snapshot applied since start
        self.revision = 0
        self.unreachable_since: float | None = None
        self.last_error = ""
        self._apply_error = ""  # the last apply failure logged (not repeated every retry)
        self._watch_now: EtcdWatch | None = None  # closed by stop(): no wait for a quiet period

    def status(self) -> dict[str, Any]:
        since = self.unreachable_since
        return {
            "source": "etcd",
            "synced": self.synced,
            "revision": self.revision,
            "reachable": since is None,
            "unreachable_s": round(time.monotonic() - since, 1) if since is not None else 0.0,
            "error": self.last_error,
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tenant-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch_now
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(timeout=WATCH_QUIET_S + 2 * APPLY_TIMEOUT_S)

    def read(self) -> dict[str, TenantRecord]:
        """One snapshot (blocking), with reachability kept up to date."""
        try:
            records, revision = self.source.snapshot()
        except EtcdError as e:
            self._down(e)
            raise
        if self.unreachable_since is not None:
            log.info(
                "tenant_source_back", after_s=round(time.monotonic() - self.unreachable_since, 1)
            )
        self.unreachable_since, self.last_error, self.revision = None, "", revision
        SOURCE_UP.set(1)
        return records

    def _down(self, e: EtcdError) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
            log.warning("tenant_source_unreachable", error=str(e)[:300],
                        serving="known tenants; changes refused until it answers")  # fmt: skip
        self.last_error = str(e)[:300]
        SOURCE_UP.set(0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                records = self.read()
                if self._loop.is_closed():  # the agent stopped without stop(): nothing to apply
                    return
                fut = asyncio.run_coroutine_threadsafe(self._apply(records), self._loop)
                fut.result(APPLY_TIMEOUT_S)
                self.synced = True
                self._watch()
            except EtcdError:
                self._stop.wait(RETRY_S)
            except Exception as e:  # an apply that failed: log (once), read again, apply again
                if repr(e) != self._apply_error:
                    log.error("tenant_apply_failed", error=repr(e)[:300], exc_info=e)
                self._apply_error = repr(e)
                self._stop.wait(RETRY_S)

    def _watch(self) -> None:
        """Until a change or a quiet period: then the caller reads the whole state again."""
        try:
            watch = self.source.client.watch(self.source.prefix, self.revision + 1, WATCH_QUIET_S)
        except EtcdUnreachable as e:
            self._down(e)
            return
        self._watch_now = watch
        try:
            if self._stop.is_set():
                return
            for _revision in watch.changed():
                return
        finally:
            self._watch_now = None
            watch.close()
