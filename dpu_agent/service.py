"""The agent as a service: engine + data plane + control server + metrics + tick loop.

The data plane (dpu_agent.dataplane) is what `[agent] mode` chooses: the embedded NVMe/TCP
target over the agent's own tiers, or SPDK's target over SPDK's namespaces. This module asks it
and never looks at the mode itself.

`run_agent(cfg)` is what `dpuctl agent run` (and `make run`) calls: it starts everything in one
asyncio loop, prints what it serves and how to try it, and on Ctrl-C or SIGTERM stops the
listeners, then closes the engine (which checkpoints), so a restart keeps committed chunks.
While running, the agent's addresses and pid are in the state file (var/agent.json), which
`dpuctl` reads to find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from prometheus_client import ProcessCollector

from dpu_agent import telemetry
from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.cluster import (
    TENANT_CHANGES_APPLIED,
    TENANT_TOKEN_BYTES,
    EtcdError,
    Membership,
    PeerAuth,
    ReceiveLimiter,
    TenantRecord,
    TenantSource,
    TenantSync,
    agent_cluster_op,
    agent_cluster_reads,
    agent_cluster_view,
    agent_cut_off,
    agent_members_since,
    plan_tenants,
    start_membership,
    tenant_source,
)
from dpu_agent.config import (
    DEFAULTS_SOURCE,
    EXIT_CONFIG,
    AgentConfig,
    ConfigError,
    TenantConfig,
    read_secret,
)
from dpu_agent.control import (
    LEASES_ACTIVE,
    RESERVATIONS_ACTIVE,
    UNAUTHENTICATED_MAX,
    UNIX_CONNECTIONS_MAX,
    ControlServer,
    Session,
    TenantRegistry,
    host_nqn_problem,
    plain,
)
from dpu_agent.control import _metrics as control_metrics
from dpu_agent.control_tls import exposure_warning, peer_client_context, server_context
from dpu_agent.dataplane import DataPlane, data_path_fds_max, data_plane
from dpu_agent.engine import Engine, EngineConfig, EngineError
from dpu_agent.engine.backup import backup_tenants, check_no_interrupted_restore
from dpu_agent.engine.engine import CHUNKS_PAGE_MAX
from dpu_agent.log import configure_logging, get_logger, lossy_std_streams
from dpu_agent.metrics import REGISTRY, forget_tenant
from dpu_agent.metrics_server import METRICS_CONNECTIONS_MAX, start_metrics_server
from dpu_agent.nixl import NixlServer
from dpu_agent.sdnotify import Notifier
from dpu_agent.tenant_store import TENANTS_FILE, TenantStore, apply_saved, write_secret
from kvproto.control import TENANTS_MAX, valid_tenant_name

__all__ = ["Agent", "banner", "run_agent"]

log = get_logger("dpu_agent.service")


# The agent process's CPU seconds, RSS and open files on /metrics (process_* series): on a
# DPU this is the Arm cores' share the agent takes.
ProcessCollector(registry=REGISTRY)


EXIT_BROKEN_INVARIANT = 70  # EX_SOFTWARE: the agent found a bug in itself


def crash(e: BaseException) -> None:
    """A broken invariant (STYLE 8): log it and exit at once, without a checkpoint of an index
    that may be wrong. Nothing acknowledged is lost: the journal is written before the index,
    and a restart rebuilds from it, as after kill -9."""
    log.critical("agent_invariant_broken", error=repr(e), exc_info=e)
    os._exit(EXIT_BROKEN_INVARIANT)


def check_tenant_name(name: str) -> None:
    """A clear error for a name a client or a manifest gave (`_admin` passes the wire check)."""
    if not valid_tenant_name(name):
        raise ValueError(
            f"{name[:80]!r} is not a tenant name: [a-z0-9][a-z0-9-]{{0,62}} (it goes into "
            "NVMe NQNs and file names)"
        )


# An admin op's handler: the agent, the request's fields -> the reply's result.
AdminOp = Callable[["Agent", Mapping[str, Any]], Awaitable[dict[str, Any]]]


class Agent:
    """One agent. Implements dpu_agent.control.ControlBackend for the control server."""

    def __init__(self, cfg: AgentConfig) -> None:
        assert cfg.admin_token, "call cfg.prepare() first"
        self.cfg = cfg
        self.lease_ttl_s = cfg.storage.lease_ttl_s
        self._config_tenants = set(cfg.tenants)  # the config file's (or the default one)
        # [cluster] etcd_endpoints: cluster-wide tenants (dpu_agent.cluster._tenants), at start
        self.tenant_source: TenantSource | None = None
        self.tenant_sync: TenantSync | None = None
        self._cluster_known: dict[str, str] = {}  # cluster tenant -> incarnation held here
        self._cluster_served: set[str] = set()  # those of cfg.tenants that came from etcd
        self._static_conflicts: set[str] = set()  # etcd names shadowed by the config (logged)
        self._tenant_failures: set[str] = set()  # cluster tenants that could not be served
        self.tenant_store = TenantStore(cfg.path(TENANTS_FILE))
        self._load_runtime_tenants()
        self.registry = TenantRegistry(
            cfg.admin_token, {name: t.token for name, t in cfg.tenants.items()}
        )
        self._engine: Engine | None = None
        self.dataplane: DataPlane = data_plane(cfg)  # the one thing `[agent] mode` chooses
        self.control: ControlServer | None = None
        self._metrics_server: Any = None
        self._started = False  # agent_stopped is logged only for an agent that started
        self._telemetry: telemetry.Installed | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._admin_lock = asyncio.Lock()
        self.cluster: Membership | None = None  # [cluster] enabled: Serf membership
        self.cluster_receiver: ReceiveLimiter | None = None  # set before Serf publishes us
        # the cluster key: proves this agent to its peers and theirs to it (cluster/_peer.py)
        self.peer_auth = (
            PeerAuth(
                cfg.agent.node_name,
                cfg.peer_keys,
                peer_client_context(cfg),
                incarnation=self._tenant_incarnation,
            )
            if cfg.cluster.enabled
            else None
        )
        self.started_at = time.time()
        # the NIXL data path (dpu_agent.nixl): its NIXL agent starts with the agent ([nixl]
        # prestart) or on a host's first use
        self.nixl_server = NixlServer(lambda: self.engine, f"dpukv-agent.{os.getpid()}")

    @property
    def engine(self) -> Engine:
        """The engine, from start() on (a call before is a bug)."""
        assert self._engine is not None, "the agent has not started"
        return self._engine

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        self._engine = await self.dataplane.open_engine(self._engine_config())
        await self.dataplane.start()
        await self._tenants_at_start()
        if cfg.nixl.prestart:  # in the background, ready before the first host asks
            self.nixl_server.prestart()
        self.control = ControlServer(
            self,
            self.registry,
            host=cfg.control.host,
            port=cfg.control.port,
            unix_path=cfg.unix_socket_path,
            connections_max=cfg.control.connections_max,
            ssl_context=server_context(cfg),  # [control] tls_cert (dpu_agent/control_tls.py)
            fatal=crash,
        )
        await self.control.start()
        if cfg.metrics.enabled:
            self._telemetry = telemetry.install(cfg)  # CPU, RDMA, SPDK stats collectors
            try:
                self._metrics_server = start_metrics_server(cfg.metrics.host, cfg.metrics.port)
            except OSError as e:  # name the port: three listeners can each be in use
                raise OSError(e.errno, f"[metrics] {cfg.metrics.host}:{cfg.metrics.port}: "
                              f"{e.strerror}") from None  # fmt: skip
        self._tick_task = asyncio.create_task(self._tick_loop(), name="engine-tick")
        if self.tenant_sync is not None:
            self.tenant_sync.start()
        if cfg.cluster.enabled:
            self.cluster = await asyncio.to_thread(start_membership, self)
        self._write_state()
        self._started = True
        log.info("agent_started", **self.addresses())

    async def stop(self) -> None:
        if self.tenant_sync is not None:
            await asyncio.to_thread(self.tenant_sync.stop)
        if self.cluster is not None:  # leave first: clients stop routing here
            await asyncio.to_thread(self.cluster.stop)
            self.cluster = None
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self.control is not None:
            await self.control.stop()
        await asyncio.to_thread(self.nixl_server.close)  # transfers in flight finish first
        await self.dataplane.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None
        if self._engine is not None:
            async with self._admin_lock:  # a backup or restore in flight finishes first
                await asyncio.to_thread(self._engine.close)  # checkpoints: restart finds all
            self._engine = None
        await self.dataplane.close()  # after the engine: its close demotes through the devices
        self._remove_state()
        if self._started:  # a refused start said why already; it did not stop a serving agent
            log.info("agent_stopped")

    def _remove_state(self) -> None:
        """Remove the state file only if this process wrote it: an agent refused at start (the
        data dir is in use) must not hide the one that runs."""
        try:
            mine = json.loads(self.cfg.state_path.read_text()).get("pid") == os.getpid()
        except (OSError, ValueError, AttributeError):
            return
        if mine:
            with contextlib.suppress(FileNotFoundError):
                self.cfg.state_path.unlink()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.agent.tick_interval_s)
            try:
                await asyncio.to_thread(self.engine.tick)  # may fsync or checkpoint
                stats = self.engine.stats()
                LEASES_ACTIVE.set(stats["leases"])
                RESERVATIONS_ACTIVE.set(stats["reservations"])
            except (EngineError, BlockDeviceError, OSError):  # operating errors: serve on
                log.exception("engine_tick_failed")
            except Exception as e:  # a bug (a broken invariant above all): never serve past it
                crash(e)

    def _engine_config(self) -> EngineConfig:
        cfg, st = self.cfg, self.cfg.storage
        return EngineConfig(
            data_dir=cfg.data_dir,
            dram_bytes=st.dram_bytes,
            nvme_bytes=st.nvme_bytes,
            eviction_policy=st.eviction_policy,
            lease_ttl_s=st.lease_ttl_s,
            reservation_ttl_s=st.reservation_ttl_s,
            policy_order_save_s=st.policy_order_save_s,
            nvme_dir=cfg.path(st.nvme_dir),
            journal_dir=cfg.path(st.journal_dir),
            key_file=cfg.path(st.key_file),
            tenants={name: t.quota_bytes for name, t in cfg.tenants.items()},
        )

    # --- addresses ----------------------------------------------------------------------------
    def addresses(self) -> dict[str, Any]:
        assert self.control is not None and self.control.tcp_address is not None
        host, port = self.control.tcp_address
        unix = self.control.unix_path
        out: dict[str, Any] = {
            "control_tcp": f"{'tls' if self.cfg.control.tls_cert else 'tcp'}://{host}:{port}",
            "control_unix": f"unix://{unix}" if unix else "",
            "nvmf": self.dataplane.address(),
            "metrics": "",
        }
        if self._metrics_server is not None:
            mhost, mport = self._metrics_server.server_address[:2]
            out["metrics"] = f"http://{mhost}:{mport}/metrics"
        return out

    def _write_state(self) -> None:
        a = self.addresses()
        state = {
            "pid": os.getpid(),
            "node": self.cfg.agent.node_name,
            "control": {"tcp": a["control_tcp"], "unix": a["control_unix"]},
            "nvmf": a["nvmf"],
            "metrics": a["metrics"],
            "started_at": self.started_at,
        }
        text = (json.dumps(state, indent=1) + "\n").encode()
        path = self.cfg.state_path
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(text)
            os.replace(tmp, path)
            return
        except OSError as e:  # a full disk: serve anyway, reads need no disk space
            with contextlib.suppress(OSError):
                tmp.unlink()
            first = e
        try:  # in place: the blocks of a file left by a killed agent need no new space
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                if os.pwrite(fd, text, 0) != len(text):
                    raise OSError(errno.ENOSPC, "short write")
                os.ftruncate(fd, len(text))
            finally:
                os.close(fd)
            return
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()  # a stale one must not name a dead (or reused) pid
        log.error("agent_state_unwritten", path=str(path), error=str(first),
                  reached_by=self.addresses()["control_unix"] or "its control port")  # fmt: skip

    # --- ControlBackend -----------------------------------------------------------------------
    def hello_info(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        """The data-path address for `tenant`; its host NQN is allowed on the subsystem."""
        info: dict[str, Any] = {
            "node": self.cfg.agent.node_name,
            "nvme": self.dataplane.hello_nvme(tenant, hostnqn, local_host),
            "lease_ttl_s": self.lease_ttl_s,
            "block_size": 4096,
        }
        if self.dataplane.offers_nixl:
            info["nixl"] = self.nixl_server.status()
        return info

    def bind_host(self, session: Session, hostnqn: str) -> None:
        """Allow `hostnqn` on the session's tenant's subsystem, from the session's peer
        address, until the session closes."""
        self.dataplane.bind_host(session, hostnqn)

    def session_closed(self, session: Session) -> None:
        self.dataplane.session_closed(session)

    def cluster_view(self, tenant: str) -> dict[str, Any]:
        view = agent_cluster_view(self, tenant)
        if self.tenant_sync is not None:  # etcd reachable? (a cut-off node says so)
            view["tenant_source"] = self.tenant_sync.status()
        return view

    def cluster_epoch(self) -> int | None:
        return self.cluster.epoch if self.cluster is not None else None

    def cluster_members_since(self, tenant: str, since: int) -> dict[str, Any] | None:
        return agent_members_since(self, tenant, since)

    def cluster_cut_off(self) -> bool:
        return agent_cut_off(self)

    def cluster_op(self, tenant: str, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        return agent_cluster_op(self, tenant, op, dict(fields))

    def cluster_reads(self, tenant: str, keys: list[bytes]) -> list[int]:
        return agent_cluster_reads(self, tenant, keys)

    async def nixl(
        self, session_id: int, tenant: str, op: str, fields: Mapping[str, Any], peer_host: str
    ) -> dict[str, Any]:
        """A NIXL data-path op of one session (dpu_agent.nixl), off the event loop; `peer_host`
        is the session's peer address (where the host's UCX address must point)."""
        if op == "nixl_connect" and self.control is not None:
            # a session of this tenant whose control connection the host has closed, not yet
            # seen because its reading waits on a transfer, still owns its host's NIXL name:
            # that host reconnecting was refused NIXL for its whole new session
            held = self.nixl_server.sessions_of(tenant, but=session_id)
            for gone in self.control.sessions_gone(held):
                self.nixl_server.session_closed(gone)
        return await self.nixl_server.handle(session_id, tenant, op, fields, peer_host)

    def nixl_session_closed(self, session_id: int) -> None:
        self.nixl_server.session_closed(session_id)

    def members(self) -> list[dict[str, Any]]:
        if self.cluster is not None:
            return list(self.cluster.view()["members"])
        a = self.addresses()
        st = self.cfg.storage
        return [
            {
                "name": self.cfg.agent.node_name,
                "status": "alive",
                "control": a["control_tcp"],
                "control_unix": a["control_unix"],
                "nvme": a["nvmf"],
                "metrics": a["metrics"],
                "capacity_bytes": (st.dram_bytes + st.nvme_bytes) * len(self.cfg.tenants),
                "tenants": len(self.cfg.tenants),
                "uptime_s": round(time.time() - self.started_at, 1),
                "pid": os.getpid(),
                "journal": self._journal_state(),
                "restore": self._restore_state(),
            }
        ]

    def _restore_state(self) -> str:
        """What an interrupted restore left and how to finish it; empty when none."""
        marker = self.engine.stats().get("restore_interrupted")
        if not marker:
            return ""
        return (f"interrupted (of {', '.join(marker.get('dirs') or ['?'])}): dpuctl backup "
                "restore --resume, or --rollback")  # fmt: skip

    def _journal_state(self) -> str:
        """`writable`, or why writes are refused (`full, ...` on a full disk)."""
        stats = self.engine.stats()
        if not stats.get("journal_fenced"):
            return "writable"
        why = "full" if stats.get("journal_full") else "unavailable"
        return f"{why}, writes refused, reads served: {stats['journal_fenced']}"

    def tenants_list(self) -> list[dict[str, Any]]:
        out = []
        for name, t in sorted(self.cfg.tenants.items()):
            source = "cluster" if name in self._cluster_served else "node"
            row: dict[str, Any] = {"name": name, "quota_bytes": t.quota_bytes, "source": source}
            with contextlib.suppress(EngineError):
                row.update(_summary(plain(self.engine.stats(name))))
            out.append(row)
        return out

    async def admin(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Admin ops one at a time, each through its entry in ADMIN_OPS; the slow ones
        (checkpoint, backup, restore) in a worker thread."""
        handler = self.ADMIN_OPS.get(op)
        if handler is None:  # kvproto's ADMIN_OPS less what the dispatcher answers itself
            raise AssertionError(f"admin op {op} has no handler")
        async with self._admin_lock:
            return await handler(self, fields)

    # --- admin ops (ADMIN_OPS) ----------------------------------------------------------------
    async def _op_tenant_add(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self.tenant_sync is not None:
            return await self._cluster_tenant_op("tenant_add", fields)
        quota = fields.get("quota_bytes") or 0
        return self._tenant_add(fields["tenant"], fields.get("token"), quota)

    async def _op_tenant_rotate(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self.tenant_sync is not None:
            return await self._cluster_tenant_op("tenant_rotate", fields)
        return self._tenant_rotate(fields["tenant"], fields.get("token"))

    async def _op_tenant_remove(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self.tenant_sync is not None:
            return await self._cluster_tenant_op("tenant_remove", fields)
        removed = self._tenant_remove(fields["tenant"])
        await asyncio.to_thread(self.dataplane.flush_keys)  # its keys gone from the file
        return removed

    async def _op_chunks_list(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        self._known(fields["tenant"])
        limit = min(fields["limit"], CHUNKS_PAGE_MAX)
        after = fields.get("after") or b""
        return {"chunks": self.engine.chunks(fields["tenant"], limit=limit, after=after)}

    async def _op_chunk_inspect(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        self._known(fields["tenant"])
        return {"chunk": self.engine.chunk(fields["tenant"], fields["key"])}

    async def _op_host_add(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """`dpuctl hosts add`: allow host `nqn` on the tenant's subsystem with issued keys."""
        tenant, nqn = fields["tenant"], fields["nqn"]
        self._known(tenant)
        if problem := host_nqn_problem(nqn):
            raise ValueError(problem)
        host = self.dataplane.host_add(tenant, nqn)
        await asyncio.to_thread(self.dataplane.flush_keys)  # the operator copies them now
        return host

    async def _op_host_list(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """`dpuctl hosts list`: hosts with issued keys, allowed or bound to a session."""
        self._known(fields["tenant"])
        return self.dataplane.host_list(fields["tenant"])

    async def _op_host_remove(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """`dpuctl hosts remove`: revoke the host's keys, end its control sessions and its
        NVMe/TCP connections, and take it off the subsystem."""
        tenant, nqn = fields["tenant"], fields["nqn"]
        self._known(tenant)

        def end_sessions() -> int:
            return self.control.end_host_sessions(tenant, nqn) if self.control is not None else 0

        removed = self.dataplane.host_remove(tenant, nqn, end_sessions)
        await asyncio.to_thread(self.dataplane.flush_keys)  # revoked on disk before the reply
        return removed

    async def _op_evict(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        self._known(fields["tenant"])
        return {"evicted": plain(self.engine.evict(fields["tenant"], fields["bytes"]))}

    # The engine is thread-safe (one lock; data I/O outside it): slow ops off the loop.
    async def _op_checkpoint(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return {"checkpoint": plain(await asyncio.to_thread(self.engine.checkpoint))}

    async def _op_backup(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        self.dataplane.check_backup("backup")
        result = await asyncio.to_thread(
            self.engine.backup, fields["dir"], incremental=fields["incremental"]
        )
        return {"backup": plain(result)}

    async def _op_restore(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        self.dataplane.check_backup("restore")
        dirs = [Path(d) for d in fields.get("dirs") or []]
        if (fields.get("mode") or "start") != "start":
            # finish an interrupted restore: resume (start over) or roll back
            result = await asyncio.to_thread(self.engine.restore, dirs, fields["mode"])
            return {"restore": plain(result), "tenants_added": {}}
        check_no_interrupted_restore(self.cfg.data_dir)  # before "holds chunks"
        quotas = backup_tenants(dirs)
        bad = [t for t in quotas if not (isinstance(t, str) and valid_tenant_name(t))]
        if bad:  # a damaged or foreign manifest: nothing is added or restored
            raise ValueError(
                f"the backup names tenant {str(bad[0])[:80]!r}, not a tenant name "
                "([a-z0-9][a-z0-9-]{0,62}); the backup is damaged or not a dpukv one"
            )
        missing = [t for t in quotas if t not in self.cfg.tenants]
        if self.engine.stats()["records"]:  # before adding tenants (the engine checks too)
            raise ValueError(
                "restore needs an agent that holds no chunks; start a fresh agent on an "
                "empty data dir (with the old key file) and restore there"
            )
        added = [self._tenant_add(n, None, quotas[n]) for n in missing]  # new tokens
        result = await asyncio.to_thread(self.engine.restore, dirs)
        tokens = {a["tenant"]: a["token_file"] for a in added}
        return {"restore": plain(result), "tenants_added": tokens}

    # op -> handler; the dispatcher answers the other ops of kvproto.control (tenants_list
    # through tenants_list above), and tests/test_service_split.py checks the two cover all
    ADMIN_OPS: ClassVar[Mapping[str, AdminOp]] = MappingProxyType({
        "tenant_add": _op_tenant_add,
        "tenant_rotate": _op_tenant_rotate,
        "tenant_remove": _op_tenant_remove,
        "chunks_list": _op_chunks_list,
        "chunk_inspect": _op_chunk_inspect,
        "host_add": _op_host_add,
        "host_list": _op_host_list,
        "host_remove": _op_host_remove,
        "evict": _op_evict,
        "checkpoint": _op_checkpoint,
        "backup": _op_backup,
        "restore": _op_restore,
    })  # fmt: skip

    def _known(self, tenant: str) -> None:
        if tenant not in self.cfg.tenants:
            raise LookupError(f"no tenant {tenant!r}; see dpuctl tenants list")

    # --- tenants at run time ------------------------------------------------------------------
    def _tenant_incarnation(self, tenant: str) -> str | None:
        """The incarnation of a tenant served from etcd, None for this node's own tenants."""
        return self._cluster_known.get(tenant) if tenant in self._cluster_served else None

    def _tenant_add(self, name: str, token: str | None, quota_bytes: int = 0) -> dict[str, Any]:
        """A tenant of this node only (no [cluster] etcd_endpoints): its token in its own 0600
        file, so that a restart serves the same token, given or generated."""
        self._check_addable(name)
        token = token or secrets.token_urlsafe(TENANT_TOKEN_BYTES)
        token_file = f"tenant-{name}.token"
        write_secret(self.cfg.path(token_file), token)  # replaces one left by an earlier name
        t = TenantConfig(name=name, token=token, token_file=token_file, quota_bytes=quota_bytes)
        self._tenant_serve(t)
        self._save_runtime_tenants()
        log.info("tenant_added", tenant=name)
        return {"tenant": name, "token": t.token, "token_file": str(self.cfg.path(t.token_file))}

    def _check_addable(self, name: str) -> None:
        check_tenant_name(name)
        if name in self.cfg.tenants:
            raise ValueError(f"tenant {name!r} exists; remove it first or pick another name")
        if len(self.cfg.tenants) >= TENANTS_MAX:  # before anything is created for it
            raise ValueError(f"already {TENANTS_MAX} tenants (TENANTS_MAX); remove one first")
        self.dataplane.check_addable(name)

    def _tenant_serve(self, t: TenantConfig) -> None:
        """Tiers, subsystem, token: the tenant is served from here on."""
        if len(self.registry.names()) >= TENANTS_MAX:  # before anything is built
            raise ValueError(f"already {TENANTS_MAX} tenants on this node (TENANTS_MAX)")
        self.engine.add_tenant(t.name, quota_bytes=t.quota_bytes)
        self.dataplane.add_tenant(t.name)
        self.cfg.tenants[t.name] = t
        self.registry.add(t.name, t.token)
        control_metrics.INTEGRITY_REPORTS.labels(t.name)  # a 0 sample before any report

    def _tenant_rotate(self, name: str, token: str | None) -> dict[str, Any]:
        """A new token for a tenant of this node; its sessions end (they used the old one)."""
        self._known(name)
        t = self.cfg.tenants[name]
        if not t.token_file:
            raise ValueError(
                f"tenant {name!r} has its token inline in {self.cfg.source}; change it there "
                "and restart the agent"
            )
        token = token or secrets.token_urlsafe(TENANT_TOKEN_BYTES)
        write_secret(self.cfg.path(t.token_file), token)
        done = self._set_token(t, token)
        log.info("tenant_token_rotated", tenant=name, **done)
        return {"tenant": name, "token": token, "token_file": str(self.cfg.path(t.token_file)),
                **done}  # fmt: skip

    def _set_token(self, t: TenantConfig, token: str) -> dict[str, Any]:
        """Serve `token` for `t`; end the sessions opened with the old one and revoke the host
        keys their hellos were issued (a leaked token's keys end with it)."""
        t.token = token
        self.registry.add(t.name, token)  # a new incarnation: old sessions are refused
        ended = self.control.end_tenant_sessions(t.name) if self.control is not None else 0
        return {"sessions_ended": ended, **self.dataplane.token_rotated(t.name)}

    def _tenant_remove(self, name: str, *, cluster: bool = False) -> dict[str, Any]:
        """Revoke the token, end its sessions, and have the data plane free what the tenant
        held (embedded: crypto-erase, its subsystem and hosts gone). A tenant added later
        under the same name gets a new token and key; the old ones are refused."""
        self._known(name)
        self.registry.remove(name)
        ended = self.control.end_tenant_sessions(name) if self.control is not None else 0
        erased = self.dataplane.remove_tenant(name)
        t = self.cfg.tenants.pop(name)
        if t.token_file:
            self.cfg.path(t.token_file).unlink(missing_ok=True)
        self._save_runtime_tenants(removed=None if cluster else name)
        forget_tenant(name)  # its series go with it
        log.info("tenant_removed", tenant=name, sessions_ended=ended, **erased)
        return {"tenant": name, "sessions_ended": ended, **erased}

    def _erase_unserved(self, name: str, why: str) -> dict[str, Any]:
        """Crypto-erase a tenant the engine holds but this node does not serve (dropped from
        the config file, or removed from the cluster while this node was down)."""
        erased = self.engine.remove_tenant(name)
        log.warning("tenant_erased", tenant=name, why=why, **erased)
        return {"tenant": name, "sessions_ended": 0, **erased}

    def _drop_unconfigured_tenants(self) -> None:
        """At start, with tenants per node: a tenant on disk that the config (and the run-time
        store) no longer names is erased, not kept: nobody can present its token any more, and
        keeping a removed tenant's data with its key is what removal must not do (the data
        plane says which: SPDK's lvols are [spdk]'s)."""
        held, configured = set(self.engine.tenants()), set(self.cfg.tenants)
        unnamed = self.dataplane.unconfigured(held, configured)
        if unnamed and self.tenant_store.damaged:  # they may be the damaged file's tenants
            log.error("tenants_kept_unserved", tenants=sorted(unnamed),
                      why=f"{self.tenant_store.damaged_path} (a damaged tenants.json) may name "
                          "them", fix="re-add each with dpuctl tenants add NAME --token-file "
                          "tenant-NAME.token, or remove it; then delete that file")  # fmt: skip
            return
        if unnamed and self.cfg.source == DEFAULTS_SOURCE:
            # No configuration file at all: a restart that forgot --config, not a removal (it
            # erased every configured tenant, keys and data, logged as a warning)
            log.error("tenants_kept_unserved", tenants=sorted(unnamed),
                      why="the agent started with no configuration file, which names none of "
                          "them", fix="start it with the configuration that names them "
                          "(--config FILE or DPUKV_CONFIG); a configuration file that leaves "
                          "one out erases it")  # fmt: skip
            return
        for name in unnamed:
            self._erase_unserved(name, f"not a tenant in {self.cfg.source}")

    # --- cluster-wide tenants ([cluster] etcd_endpoints) -------------------------------------
    async def _tenants_at_start(self) -> None:
        """Before the control server opens: per-node tenants drop what the config dropped;
        cluster tenants are served only after a read of etcd has been applied (a removal made
        while this node was down is applied first)."""
        self.tenant_source = tenant_source(self.cfg, read_secret)  # a bad secret file: refused
        if self.tenant_source is None:
            self._drop_unconfigured_tenants()
            return
        loop = asyncio.get_running_loop()
        self.tenant_sync = TenantSync(self.tenant_source, self.apply_tenants, loop)
        try:
            records = await asyncio.to_thread(self.tenant_sync.read)
        except EtcdError:
            serving = "config-file tenants; cluster tenants once etcd answers"
            log.warning("cluster_tenants_deferred", serving=serving)
            return
        async with self._admin_lock:
            self._apply_tenant_plan(records)
        self.tenant_sync.synced = True

    async def apply_tenants(self, records: dict[str, TenantRecord]) -> None:
        """TenantSync's hook: make this node's cluster tenants match `records`."""
        async with self._admin_lock:
            self._apply_tenant_plan(records)

    def _apply_tenant_plan(self, records: dict[str, TenantRecord]) -> dict[str, dict[str, Any]]:
        """Plan and apply (admin lock held); what each erasure did, by tenant."""
        served = {n: (self.cfg.tenants[n].token, self.cfg.tenants[n].quota_bytes)
                  for n in self._cluster_served}  # fmt: skip
        static = set(self.cfg.tenants) - self._cluster_served
        for name in (set(records) & static) - self._static_conflicts:
            self._static_conflicts.add(name)
            log.error("cluster_tenant_shadowed", tenant=name,
                      why=f"{self.cfg.source} names it: this node serves its own")  # fmt: skip
        steps = plan_tenants(records, static=static, known=self._cluster_known, served=served,
                             engine=set(self.engine.tenants()))  # fmt: skip
        out: dict[str, dict[str, Any]] = {}
        applied = []
        for step in steps:
            if step.kind == "erase":
                if step.name in self._cluster_served:
                    out[step.name] = self._tenant_remove(step.name, cluster=True)
                elif step.name in self.engine.tenants():
                    out[step.name] = self._erase_unserved(step.name, step.why)
                self._cluster_served.discard(step.name)
                self._cluster_known.pop(step.name, None)
                TENANT_CHANGES_APPLIED.labels("erase").inc()
                applied.append(f"erase:{step.name}")
            else:
                assert step.record is not None, step
                try:
                    self._apply_tenant_step(step.kind, step.record)
                except (ValueError, EngineError) as e:  # limits: this tenant, not the others
                    if step.name not in self._tenant_failures:
                        log.error("cluster_tenant_not_applied", tenant=step.name,
                                  step=step.kind, error=str(e)[:300])  # fmt: skip
                    self._tenant_failures.add(step.name)
                    continue
                self._tenant_failures.discard(step.name)
                TENANT_CHANGES_APPLIED.labels(step.kind).inc()
                applied.append(f"{step.kind}:{step.name}")
        if applied:
            self._save_runtime_tenants()
            log.info("cluster_tenants_applied", steps=applied[:64])
        return out

    def _apply_tenant_step(self, kind: str, rec: TenantRecord) -> None:
        if kind == "add":
            t = TenantConfig(name=rec.name, token=rec.token, quota_bytes=rec.quota_bytes,
                             replicas=rec.replicas)  # fmt: skip
            self._cluster_known[rec.name] = rec.incarnation
            self._save_runtime_tenants()  # known before its first chunk is written
            self._tenant_serve(t)
            self._cluster_served.add(rec.name)
        elif kind == "token":
            self._set_token(self.cfg.tenants[rec.name], rec.token)
        elif kind == "quota":
            self.engine.add_tenant(rec.name, quota_bytes=rec.quota_bytes)
            self.cfg.tenants[rec.name].quota_bytes = rec.quota_bytes

    async def _cluster_tenant_op(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """`tenants add|rotate|remove` with etcd: write there (compare-and-swap), read back and
        apply here now; the other nodes apply it from their watch within seconds."""
        assert self.tenant_sync is not None and self.tenant_source is not None
        name, src = fields["tenant"], self.tenant_source
        if name in self.cfg.tenants and name not in self._cluster_served:
            raise ValueError(f"tenant {name!r} is this node's own ({self.cfg.source} or added "
                             "before etcd_endpoints was set); remove it here first")  # fmt: skip
        if op == "tenant_add":
            check_tenant_name(name)
        token = fields.get("token") or secrets.token_urlsafe(TENANT_TOKEN_BYTES)
        try:
            if op == "tenant_add":
                await asyncio.to_thread(src.add, name, token, fields.get("quota_bytes") or 0)
            elif op == "tenant_rotate":
                await asyncio.to_thread(src.rotate, name, token)
            else:
                await asyncio.to_thread(src.remove, name)
        except EtcdError as e:
            raise ValueError(
                f"etcd did not take the change ({e}); nothing was applied here; dpuctl "
                "tenants list shows what etcd holds once it answers"
            ) from None
        try:
            records = await asyncio.to_thread(self.tenant_sync.read)
        except EtcdError as e:
            raise ValueError(
                f"etcd took the change but did not answer the read back ({e}); this node "
                "applies it when etcd answers"
            ) from None
        erased = self._apply_tenant_plan(records)
        log.info("cluster_tenant_changed", op=op, tenant=name)
        if op == "tenant_remove":
            return erased.get(name, {"tenant": name})
        return {"tenant": name, "token": token, "source": "etcd"}

    def _load_runtime_tenants(self) -> None:
        """The config file's tenants with the run-time changes of tenants.json applied."""
        saved = self.tenant_store.load()
        apply_saved(self.cfg.tenants, saved)
        self._cluster_known.update(saved.cluster)
        self.cfg.prepare()  # loads the tokens of the tenants just added

    def _save_runtime_tenants(self, removed: str | None = None) -> None:
        """tenants.json: this node's run-time tenants (added: not in the config file), config
        tenants removed at run time, and the incarnation of each cluster tenant held here."""
        added = {
            name: t
            for name, t in self.cfg.tenants.items()
            if name not in self._config_tenants and name not in self._cluster_served
        }
        self.tenant_store.save(
            added=added,
            present=self.cfg.tenants,
            cluster=self._cluster_known,
            configured=self._config_tenants,
            removed=removed,
        )


def _summary(stats: Any) -> dict[str, Any]:
    """The few per-tenant numbers `tenants list` shows."""
    if not isinstance(stats, dict):
        return {}
    keep = ("records", "used_bytes", "hits", "misses", "evictions", "integrity_failures")
    return {k: v for k, v in stats.items() if k in keep}


def banner(cfg: AgentConfig, addr: Mapping[str, Any], plane: DataPlane) -> str:
    tenant = "default" if "default" in cfg.tenants else next(iter(cfg.tenants), "default")
    t = cfg.tenants.get(tenant)
    if t is not None and t.token_file:
        token_file = str(cfg.path(t.token_file))
        where, read = f"token in {token_file}", f'open("{token_file}").read().strip()'
    else:  # inline in the config file: it said "token in <data dir>" and opened the directory
        where, read = f"token in {cfg.source} ([tenants.{tenant}] token)", '"<its token>"'
    # dpuctl in another terminal must find the same data directory (and so the agent)
    env = "" if cfg.agent.data_dir == "./var" else f"DPUKV_AGENT_DATA_DIR={cfg.data_dir} "
    opt = "" if cfg.source == "<defaults>" else f" --config {cfg.source}"
    nqn = plane.subsystem_nqn(tenant)
    return f"""dpukv agent {cfg.agent.node_name} is serving (Ctrl-C stops it)
  control   {addr["control_tcp"]}  {addr["control_unix"]}
  NVMe/TCP  {addr["nvmf"]}  (subsystem {nqn})
  metrics   {addr["metrics"] or "disabled"}
  data      {cfg.data_dir}
  tenant    {tenant}, {where}

Try it (in another terminal):
  {env}.venv/bin/dpuctl status{opt}
  {env}.venv/bin/dpuctl stats --json{opt}
  .venv/bin/python - <<'PY'
import numpy as np
from host_shim import KVClient
from kvproto.keys import ChunkLayout
L = ChunkLayout("demo", "float16", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)
token = {read}
c = KVClient("{addr["control_tcp"]}", "{tenant}", token, L, salt=b"my-tenant-salt-16b")
tokens = list(range(64))
print("put", c.put(tokens, [np.full(L.chunk_shape, i, np.float16) for i in range(4)]))
out = [np.empty(L.chunk_shape, np.float16) for _ in range(4)]
print("get", c.get(tokens, out), "chunks; first value of chunk 3:", out[3].flat[0])
PY
"""


async def _serve(cfg: AgentConfig) -> int:
    try:
        agent = Agent(cfg)  # tenants.json's run-time tenants and their token files load here
    except ConfigError as e:  # a token file a run-time change left unloadable: a traceback
        print(f"error: cannot start the agent: {e}", file=sys.stderr)
        return EXIT_CONFIG
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
    except OSError as e:
        hint = ""
        if e.errno == errno.EADDRINUSE:  # other errors (a missing tls_cert file, ENOMEM) got
            hint = (" Is another agent running (dpuctl status)? Ports: [control] port, [nvmf] "
                    "port, [metrics] port in the config, or DPUKV_CONTROL_PORT / "
                    "DPUKV_NVMF_PORT / DPUKV_METRICS_PORT (0 picks a free one).")  # fmt: skip
        where = f" ({e.filename})" if e.filename and str(e.filename) not in str(e) else ""
        print(f"error: cannot start the agent: {e}{where}.{hint}", file=sys.stderr)
        await agent.stop()
        return 1
    except ConfigError as e:
        print(f"error: cannot start the agent: {e}", file=sys.stderr)
        await agent.stop()
        return EXIT_CONFIG
    except Exception as e:  # key file, journal, devices: say what, not a traceback
        print(f"error: cannot start the agent: {type(e).__name__}: {e}", file=sys.stderr)
        await agent.stop()
        return 1
    print(banner(cfg, agent.addresses(), agent.dataplane), flush=True)
    if warning := exposure_warning(cfg):
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
        log.warning("control_plane_exposed", host=cfg.control.host, port=cfg.control.port)
    notifier = Notifier()  # systemd Type=notify: READY=1, watchdog pings (no-op otherwise)
    notifier.ready(f"serving {len(cfg.tenants)} tenant(s)")
    await stop.wait()
    await notifier.stopping()
    print("stopping: closing listeners, checkpointing the index ...", flush=True)
    await agent.stop()
    print("stopped", flush=True)
    return 0


# Descriptors beyond the connections' bounds: journal segments, tier files, the checkpoint,
# the NIXL worker's socket and memory, Serf's RPC, SPDK's socket, the log
FD_HEADROOM = 256
# The soft limit set where there is no hard one: the kernel's usual fs.nr_open
FD_LIMIT_UNBOUNDED = 1 << 20


def fds_needed(cfg: AgentConfig) -> int:
    """Descriptors the agent may hold at once with every connection bound reached: tenants'
    control connections, strangers before hello, the operator's Unix socket, the data path's
    queues (the embedded NVMe/TCP target's), metrics scrapers, and FD_HEADROOM."""
    return (cfg.control.connections_max + UNAUTHENTICATED_MAX + UNIX_CONNECTIONS_MAX
            + data_path_fds_max(cfg) + METRICS_CONNECTIONS_MAX + FD_HEADROOM)  # fmt: skip


def raise_fd_limit(cfg: AgentConfig) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (the soft 1,024 exists for select(), which
    the agent does not use on sockets); returns (soft limit now, descriptors needed). Below
    what the connection bounds need, a flood of connections would take the descriptors the
    journal and the tenants' sockets need (EMFILE): the caller warns."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, FD_LIMIT_UNBOUNDED)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft, fds_needed(cfg)


def run_agent(cfg: AgentConfig) -> int:
    """Run in the foreground until SIGINT/SIGTERM; returns the process exit code."""
    lossy_std_streams()  # a full disk under the log, or its reader gone, stops no tenant
    configure_logging(level=cfg.agent.log_level, console=sys.stderr.isatty())
    fd_limit, needed = raise_fd_limit(cfg)
    if fd_limit < needed:
        log.warning("fd_limit_low", limit=fd_limit, needed=needed,
                    fix="raise the hard limit: LimitNOFILE= in the unit, ulimit -Hn, or "
                        "lower [control] connections_max")  # fmt: skip
    return asyncio.run(_serve(cfg))
