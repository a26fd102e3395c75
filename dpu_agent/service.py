"""The agent as a service: engine + NVMe/TCP target + control server + metrics + tick loop.

In SPDK mode (`[agent] mode = "spdk"`) there is no NVMe/TCP target here: the tiers are SPDK's
namespaces, reached through the agent's own initiator (dpu_agent.spdk_mode), and hello points
hosts at SPDK's listener for their tenant's subsystem.

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
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import ProcessCollector, start_http_server

from dpu_agent import telemetry
from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.cluster import (
    TENANT_CHANGES_APPLIED,
    TENANT_TOKEN_BYTES,
    EtcdError,
    Membership,
    PeerAuth,
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
from dpu_agent.config import AgentConfig, TenantConfig, read_secret
from dpu_agent.control import (
    LEASES_ACTIVE,
    RESERVATIONS_ACTIVE,
    ControlServer,
    Session,
    TenantRegistry,
    host_nqn_problem,
    plain,
)
from dpu_agent.control import _metrics as control_metrics
from dpu_agent.control_tls import exposure_warning, peer_client_context, server_context
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import Engine, EngineConfig, EngineError, LimitExceeded, UnknownTenant
from dpu_agent.engine.backup import backup_tenants, check_no_interrupted_restore
from dpu_agent.engine.engine import CHUNKS_PAGE_MAX
from dpu_agent.log import configure_logging, get_logger, nqn_tag
from dpu_agent.metrics import REGISTRY, forget_tenant
from dpu_agent.nixl import NixlServer
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, TargetOptions, tenant_nqn
from dpu_agent.nvmf._keys import HOST_KEYS_FILE, HostKeyIssuer, hello_keys
from dpu_agent.sdnotify import Notifier
from dpu_agent.spdk_mode import SpdkDevices, check_spdk, listener_for
from kvproto.control import TENANTS_MAX, valid_tenant_name

__all__ = ["Agent", "AgentProcess", "run_agent", "spawn_agent"]

log = get_logger("dpu_agent.service")

TENANTS_FILE = "tenants.json"  # tenants added or removed at run time (tokens in their own files)
# Host NQNs allowed per subsystem at once (each bound to a live control session): a fleet of
# GPU servers. Beyond it a hello is refused; nobody else's entry is pushed out.
HOSTS_PER_TENANT_MAX = 4096
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1"})  # where a Unix-socket client's NVMe/TCP comes from
TENANT_EVICT_ALL_BYTES = 1 << 62  # "everything": more than any tier holds


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
        self._load_runtime_tenants()
        self.registry = TenantRegistry(
            cfg.admin_token, {name: t.token for name, t in cfg.tenants.items()}
        )
        self.engine: Any = None
        self.target: Any = None
        self.control: ControlServer | None = None
        self._metrics_server: Any = None
        self._started = False  # agent_stopped is logged only for an agent that started
        self._telemetry: telemetry.Installed | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._admin_lock = asyncio.Lock()
        self._subsystems: dict[str, Subsystem] = {}
        # tenant -> host NQN -> {control session id: its peer address}: an allowlist entry
        # lives exactly as long as a session that bound it (bind_host / session_closed)
        self._bindings: dict[str, dict[str, dict[int, str]]] = {}
        self._spdk_devices: SpdkDevices | None = None
        self.cluster: Membership | None = None  # [cluster] enabled: Serf membership
        # the cluster key: proves this agent to its peers and theirs to it (cluster/_peer.py)
        self.peer_auth = (
            PeerAuth(cfg.agent.node_name, cfg.peer_keys, peer_client_context(cfg))
            if cfg.cluster.enabled
            else None
        )
        self.started_at = time.time()
        self.host_keys = HostKeyIssuer(  # issued DH-HMAC-CHAP secrets / TLS PSKs per host
            cfg.path(HOST_KEYS_FILE), dhchap=cfg.nvmf.require_auth, psk=cfg.nvmf.secure_channel
        )
        # the NIXL data path (dpu_agent.nixl): its NIXL agent starts on a host's first use
        self.nixl_server = NixlServer(lambda: self.engine, f"dpukv-agent.{os.getpid()}")

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        if cfg.spdk_mode:
            self.engine = await asyncio.to_thread(self._start_spdk)
        else:
            self.engine = Engine(self._engine_config())
            subsystems = [self._subsystem(name) for name in self.cfg.tenants]
            options = TargetOptions(
                max_io_size=cfg.nvmf.max_io_size,
                io_workers=cfg.nvmf.io_workers,
                data_buffers_per_queue=cfg.nvmf.data_buffers_per_queue,
            )
            self.target = NvmeTcpTarget(
                subsystems,
                cfg.nvmf.host,
                cfg.nvmf.port,
                options=options,
                secure_channel=cfg.nvmf.secure_channel,
            )
            await self.target.start()
        await self._tenants_at_start()
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
                self._metrics_server, _ = start_http_server(
                    cfg.metrics.port, addr=cfg.metrics.host, registry=REGISTRY
                )
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

    def _start_spdk(self) -> Engine:
        """Check SPDK against [spdk] (plan, or apply), connect each tier, build the engine."""
        cfg = self.cfg
        assert cfg.spdk is not None, "load_config checks SPDK mode has [spdk]"
        keystore = KeyStore(cfg.path(cfg.storage.key_file))  # SPDK's crypto keys come from it
        apply_on_start = cfg.agent.spdk_apply_on_start
        check_spdk(cfg.spdk, keystore, apply_on_start=apply_on_start, source=cfg.source)
        tiers = [t for t in cfg.spdk_tiers() if t.tenant in cfg.tenants]
        self._spdk_devices = SpdkDevices.connect(tiers)
        return Engine(self._engine_config(), device_factory=self._spdk_devices)

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
        if self.target is not None:
            await self.target.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None
        if self.engine is not None:
            async with self._admin_lock:  # a backup or restore in flight finishes first
                await asyncio.to_thread(self.engine.close)  # checkpoints: restart finds all
            self.engine = None
        if self._spdk_devices is not None:  # after the engine: its close demotes through them
            self._spdk_devices.close()
            self._spdk_devices = None
        await asyncio.to_thread(self.host_keys.close)  # issued keys pending a batched write
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
            nvme_dir=cfg.path(st.nvme_dir),
            journal_dir=cfg.path(st.journal_dir),
            key_file=cfg.path(st.key_file),
            tenants={name: t.quota_bytes for name, t in cfg.tenants.items()},
        )

    def _subsystem(self, tenant: str) -> Subsystem:
        """The tenant's subsystem: its namespaces only, reachable only by hosts it said hello
        from (hello_info adds each authenticated client's host NQN)."""
        sub = Subsystem(nqn=tenant_nqn(tenant), namespaces=self.engine.namespaces(tenant))
        sub.require_auth = self.cfg.nvmf.require_auth
        sub.secure_channel = self.cfg.nvmf.secure_channel
        self.host_keys.bind(tenant, sub)
        self._subsystems[tenant] = sub
        self._bindings[tenant] = {}
        return sub

    # --- addresses ----------------------------------------------------------------------------
    def addresses(self) -> dict[str, Any]:
        assert self.control is not None and self.control.tcp_address is not None
        host, port = self.control.tcp_address
        unix = self.control.unix_path
        out: dict[str, Any] = {
            "control_tcp": f"{'tls' if self.cfg.control.tls_cert else 'tcp'}://{host}:{port}",
            "control_unix": f"unix://{unix}" if unix else "",
            "nvmf": self._nvmf_address(),
            "metrics": "",
        }
        if self._metrics_server is not None:
            mhost, mport = self._metrics_server.server_address[:2]
            out["metrics"] = f"http://{mhost}:{mport}/metrics"
        return out

    def _nvmf_address(self) -> str:
        if self.target is not None:
            return f"{self.target.host}:{self.target.port}"
        assert self.cfg.spdk is not None, "SPDK mode"
        first = next(iter(self.cfg.tenants), "")
        nv = listener_for(self.cfg.spdk, first, "")  # SPDK's listener for the hosts
        return f"{nv['host']}:{nv['port']}" if nv else ""

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
        if self.cfg.spdk is not None and self.cfg.spdk_mode:
            return self._spdk_hello(tenant, local_host)
        host, port = self.target.host, self.target.port
        if host in ("0.0.0.0", "::", ""):  # a wildcard bind: the address the client reached
            host = local_host
        nvme: dict[str, Any] = {"host": host, "port": port, "subnqn": tenant_nqn(tenant)}
        if hostnqn and self.host_keys.enabled:  # keys are issued, not invented
            nvme.update(hello_keys(self.host_keys.issue(tenant, self._subsystems[tenant], hostnqn)))
        return {
            "node": self.cfg.agent.node_name,
            "nvme": nvme,
            "lease_ttl_s": self.lease_ttl_s,
            "block_size": 4096,
            "nixl": self.nixl_server.status(),
        }

    def _spdk_hello(self, tenant: str, local_host: str) -> dict[str, Any]:
        """SPDK's listener and the tenant's subsystem. The allowlist is [spdk]'s `hosts` (plan
        reconciles it), so hello adds nothing: an unlisted host NQN is refused at connect."""
        assert self.cfg.spdk is not None
        nv = listener_for(self.cfg.spdk, tenant, local_host)
        assert nv is not None, f"load_config checks tenant {tenant} has an SPDK subsystem"
        return {
            "node": self.cfg.agent.node_name,
            "nvme": nv,
            "lease_ttl_s": self.lease_ttl_s,
            "block_size": 4096,
        }

    def bind_host(self, session: Session, hostnqn: str) -> None:
        """Allow `hostnqn` on the session's tenant's subsystem, from the session's peer
        address, until the session closes. (SPDK mode: the allowlist is [spdk]'s `hosts`.)"""
        if self.cfg.spdk_mode:
            return
        hosts = self._bindings.get(session.tenant)
        if hosts is None:
            raise UnknownTenant(f"tenant {session.tenant!r} has no subsystem")
        if hostnqn not in hosts and len(hosts) >= HOSTS_PER_TENANT_MAX:
            raise LimitExceeded(
                f"tenant {session.tenant!r} has {HOSTS_PER_TENANT_MAX} hosts connected "
                "(HOSTS_PER_TENANT_MAX); close some clients first"
            )
        hosts.setdefault(hostnqn, {})[session.session_id] = session.peer_host
        self._apply_host(session.tenant, hostnqn)
        log.info("host_bound", tenant=session.tenant, host=nqn_tag(hostnqn),
                 session=session.session_id)  # fmt: skip

    def session_closed(self, session: Session) -> None:
        hosts = self._bindings.get(session.tenant)
        if hosts is None or session.hostnqn not in hosts:
            return  # the tenant went first
        peers = hosts[session.hostnqn]
        peers.pop(session.session_id, None)
        if peers:
            self._apply_host(session.tenant, session.hostnqn)
            return
        del hosts[session.hostnqn]
        sub = self._subsystems[session.tenant]
        sub.allowed_hosts.discard(session.hostnqn)
        sub.host_peers.pop(session.hostnqn, None)
        if self.target is not None:  # its data-path connections end with it
            self.target.disconnect_host(sub.nqn, session.hostnqn)
        log.info("host_unbound", tenant=session.tenant, host=nqn_tag(session.hostnqn))

    def _apply_host(self, tenant: str, hostnqn: str) -> None:
        sub = self._subsystems[tenant]
        addresses: set[str] = set()
        for peer in self._bindings[tenant][hostnqn].values():
            addresses |= {peer} if peer else LOOPBACK_HOSTS  # "": the Unix socket
        sub.allowed_hosts.add(hostnqn)
        sub.host_peers[hostnqn] = frozenset(addresses)

    def _allow_host(self, tenant: str, hostnqn: str) -> None:
        """An operator-added host (`dpuctl hosts add`): allowed from any address while the
        tenant exists, not bound to a control session; with `[nvmf] require_auth` it must still
        prove its issued secret (without it, its NQN is all it shows)."""
        sub = self._subsystems[tenant]
        sub.allowed_hosts.add(hostnqn)
        sub.host_peers.pop(hostnqn, None)

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
        """Admin ops one at a time; the slow ones (backup, restore) in a worker thread."""
        async with self._admin_lock:
            if op in ("tenant_add", "tenant_rotate", "tenant_remove") and self.tenant_sync:
                return await self._cluster_tenant_op(op, fields)
            if op == "tenant_rotate":
                return self._tenant_rotate(fields["tenant"], fields.get("token"))
            if op == "tenant_add":
                return self._tenant_add(
                    fields["tenant"], fields.get("token"), fields.get("quota_bytes") or 0
                )
            if op == "tenant_remove":
                removed = self._tenant_remove(fields["tenant"])
                await asyncio.to_thread(self.host_keys.flush)  # its keys gone from the file
                return removed
            if op == "chunks_list":
                self._known(fields["tenant"])
                limit = min(fields["limit"], CHUNKS_PAGE_MAX)
                after = fields.get("after") or b""
                return {"chunks": self.engine.chunks(fields["tenant"], limit=limit, after=after)}
            if op == "chunk_inspect":
                self._known(fields["tenant"])
                return {"chunk": self.engine.chunk(fields["tenant"], fields["key"])}
            if op == "host_add":
                host = self._host_add(fields["tenant"], fields["nqn"])
                await asyncio.to_thread(self.host_keys.flush)  # the operator copies them now
                return host
            if op == "host_list":
                return self._host_list(fields["tenant"])
            if op == "host_remove":
                removed = self._host_remove(fields["tenant"], fields["nqn"])
                await asyncio.to_thread(self.host_keys.flush)  # revoked on disk before the reply
                return removed
            if op == "evict":
                self._known(fields["tenant"])
                return {"evicted": plain(self.engine.evict(fields["tenant"], fields["bytes"]))}
            # The engine is thread-safe (one lock; data I/O outside it): slow ops off the loop.
            if op == "checkpoint":
                return {"checkpoint": plain(await asyncio.to_thread(self.engine.checkpoint))}
            if op in ("backup", "restore") and self.cfg.spdk_mode:
                # the agent sees plaintext through SPDK's crypto vbdev: a backup would hold it
                raise ValueError(
                    f"{op} is not available in SPDK mode (the agent reads plaintext through "
                    "SPDK's crypto vbdev); back up the lvols with SPDK's snapshots instead"
                )
            if op == "backup":
                result = await asyncio.to_thread(
                    self.engine.backup, fields["dir"], incremental=fields["incremental"]
                )
                return {"backup": plain(result)}
            if op == "restore" and (fields.get("mode") or "start") != "start":
                # finish an interrupted restore: resume (start over) or roll back
                dirs = [Path(d) for d in fields.get("dirs") or []]
                result = await asyncio.to_thread(self.engine.restore, dirs, fields["mode"])
                return {"restore": plain(result), "tenants_added": {}}
            if op == "restore":
                dirs = [Path(d) for d in fields.get("dirs") or []]
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
        raise AssertionError(f"admin op {op} has no handler")

    def _known(self, tenant: str) -> None:
        if tenant not in self.cfg.tenants:
            raise LookupError(f"no tenant {tenant!r}; see dpuctl tenants list")

    # --- tenants at run time ------------------------------------------------------------------
    def _tenant_add(self, name: str, token: str | None, quota_bytes: int = 0) -> dict[str, Any]:
        """A tenant of this node only (no [cluster] etcd_endpoints): its token in its own 0600
        file, so that a restart serves the same token, given or generated."""
        self._check_addable(name)
        token = token or secrets.token_urlsafe(TENANT_TOKEN_BYTES)
        token_file = f"tenant-{name}.token"
        _write_secret(self.cfg.path(token_file), token)  # replaces one left by an earlier name
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
        if self.cfg.spdk_mode:  # its tiers are SPDK namespaces, connected at start
            raise ValueError(
                f"SPDK mode: add tenant {name!r} to [tenants] and its [[spdk.subsystems]] in "
                f"{self.cfg.source}, then restart the agent"
            )

    def _tenant_serve(self, t: TenantConfig) -> None:
        """Tiers, subsystem, token: the tenant is served from here on."""
        if len(self.registry.names()) >= TENANTS_MAX:  # before anything is built
            raise ValueError(f"already {TENANTS_MAX} tenants on this node (TENANTS_MAX)")
        self.engine.add_tenant(t.name, quota_bytes=t.quota_bytes)
        self.target.add_subsystem(self._subsystem(t.name))
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
        _write_secret(self.cfg.path(t.token_file), token)
        ended = self._set_token(t, token)
        log.info("tenant_token_rotated", tenant=name, sessions_ended=ended)
        return {"tenant": name, "token": token, "token_file": str(self.cfg.path(t.token_file)),
                "sessions_ended": ended}  # fmt: skip

    def _set_token(self, t: TenantConfig, token: str) -> int:
        """Serve `token` for `t` and end the sessions opened with the old one."""
        t.token = token
        self.registry.add(t.name, token)  # a new incarnation: old sessions are refused
        return self.control.end_tenant_sessions(t.name) if self.control is not None else 0

    def _host_add(self, tenant: str, nqn: str) -> dict[str, Any]:
        """`dpuctl hosts add`: allow host `nqn` on the tenant's subsystem with issued keys."""
        self._known(tenant)
        if problem := host_nqn_problem(nqn):
            raise ValueError(problem)
        if self.target is None:
            raise ValueError("SPDK mode: hosts and their keys are [spdk]'s (keyring files)")
        self._allow_host(tenant, nqn)
        keys = {}
        if self.host_keys.enabled:
            keys = hello_keys(
                self.host_keys.issue(tenant, self._subsystems[tenant], nqn, any_address=True)
            )
        log.info("host_added", tenant=tenant, keys=sorted(keys))
        return {"tenant": tenant, "hostnqn": nqn, "subnqn": tenant_nqn(tenant), **keys}

    def _host_list(self, tenant: str) -> dict[str, Any]:
        """`dpuctl hosts list`: hosts with issued keys, allowed or bound to a session."""
        self._known(tenant)
        if self.target is None:
            raise ValueError("SPDK mode: hosts and their keys are [spdk]'s (keyring files)")
        keyed = self.host_keys.hosts(tenant)
        sub = self._subsystems[tenant]
        bound = self._bindings.get(tenant, {})
        names = set(keyed) | set(sub.allowed_hosts) | set(bound)
        rows = [
            {
                "hostnqn": h,
                "keys": keyed.get(h, {}).get("keys", []),
                "operator_added": keyed.get(h, {}).get("operator_added", False),
                "allowed": h in sub.allowed_hosts,
                "sessions": len(bound.get(h, {})),
            }
            for h in sorted(names)
        ]
        return {"tenant": tenant, "hosts": rows}

    def _host_remove(self, tenant: str, nqn: str) -> dict[str, Any]:
        """`dpuctl hosts remove`: revoke the host's keys, end its control sessions and its
        NVMe/TCP connections, and take it off the subsystem."""
        self._known(tenant)
        if self.target is None:
            raise ValueError("SPDK mode: hosts and their keys are [spdk]'s (keyring files)")
        sub = self._subsystems[tenant]
        known = nqn in sub.allowed_hosts or nqn in self._bindings.get(tenant, {})
        revoked = self.host_keys.forget_host(tenant, nqn)
        if not (known or revoked):
            raise LookupError(f"no host {nqn[:64]!r} on tenant {tenant!r}; see dpuctl hosts list")
        ended = self.control.end_host_sessions(tenant, nqn) if self.control is not None else 0
        self._bindings.get(tenant, {}).pop(nqn, None)
        sub.allowed_hosts.discard(nqn)
        sub.host_peers.pop(nqn, None)
        sub.host_keys.pop(nqn, None)
        self.target.disconnect_host(sub.nqn, nqn)
        log.info("host_removed", tenant=tenant, host=nqn_tag(nqn), sessions_ended=ended)
        return {"tenant": tenant, "hostnqn": nqn, "keys_revoked": revoked, "sessions_ended": ended}

    def _tenant_remove(self, name: str, *, cluster: bool = False) -> dict[str, Any]:
        """Crypto-erase: revoke the token, end its sessions, remove its subsystem (its hosts
        are disconnected), destroy its XTS key and free its space. A tenant added later under
        the same name gets a new token and key; the old ones are refused."""
        self._known(name)
        self.registry.remove(name)
        ended = self.control.end_tenant_sessions(name) if self.control is not None else 0
        if self.target is not None:  # SPDK mode: the subsystem is SPDK's, kept
            self.target.remove_subsystem(tenant_nqn(name))
        self._subsystems.pop(name, None)
        self.host_keys.forget_tenant(name)
        self._bindings.pop(name, None)
        if self.cfg.spdk_mode:  # the tiers are SPDK's namespaces: drop what is unleased
            erased = {"freed_bytes": self.engine.evict(name, TENANT_EVICT_ALL_BYTES)}
        else:
            erased = self.engine.remove_tenant(name)
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
        keeping a removed tenant's data with its key is what removal must not do."""
        if self.cfg.spdk_mode:
            return  # SPDK's lvols are [spdk]'s: `dpuctl spdk plan` reports what is extra
        for name in sorted(set(self.engine.tenants()) - set(self.cfg.tenants)):
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

    def _runtime_tenants_path(self) -> Path:
        return self.cfg.path(TENANTS_FILE)

    def _load_runtime_tenants(self) -> None:
        try:
            doc = json.loads(self._runtime_tenants_path().read_text())
            if not isinstance(doc, dict):
                raise ValueError(f"not a JSON object: {type(doc).__name__}")
        except FileNotFoundError:
            return
        except (ValueError, OSError) as e:  # damaged: start with the configured tenants
            log.error("runtime_tenants_unreadable", path=str(self._runtime_tenants_path()),
                      error=str(e), dropped="tenants added or removed at run time")  # fmt: skip
            return
        for name, entry in doc.get("added", {}).items():
            if valid_tenant_name(name) and name not in self.cfg.tenants:
                t = TenantConfig(
                    name=name,
                    token_file=entry.get("token_file", ""),
                    quota_bytes=int(entry.get("quota_bytes", 0)),
                )
                self.cfg.tenants[name] = t
        for name in doc.get("removed", []):
            self.cfg.tenants.pop(name, None)
        for name, entry in doc.get("cluster", {}).items():
            if valid_tenant_name(name) and isinstance(entry, dict):
                self._cluster_known[name] = str(entry.get("incarnation", ""))
        self.cfg.prepare()  # loads the tokens of the tenants just added

    def _save_runtime_tenants(self, removed: str | None = None) -> None:
        """tenants.json: this node's run-time tenants (added: not in the config file), config
        tenants removed at run time, and the incarnation of each cluster tenant held here."""
        path = self._runtime_tenants_path()
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            doc = {"added": {}, "removed": []}
        doc["added"] = {
            name: {"token_file": t.token_file, "quota_bytes": t.quota_bytes}
            for name, t in self.cfg.tenants.items()
            if name not in self._config_tenants and name not in self._cluster_served
        }
        if removed:
            doc["removed"] = sorted({*doc["removed"], removed})
        doc["removed"] = [n for n in doc["removed"] if n not in self.cfg.tenants]
        doc["cluster"] = {n: {"incarnation": inc} for n, inc in sorted(self._cluster_known.items())}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)


def _write_secret(path: Path, value: str) -> None:
    """`value` in `path`, mode 0600 from creation, replacing what was there atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)


def _summary(stats: Any) -> dict[str, Any]:
    """The few per-tenant numbers `tenants list` shows."""
    if not isinstance(stats, dict):
        return {}
    keep = ("records", "used_bytes", "hits", "misses", "evictions", "integrity_failures")
    return {k: v for k, v in stats.items() if k in keep}


def banner(cfg: AgentConfig, addr: Mapping[str, Any]) -> str:
    tenant = "default" if "default" in cfg.tenants else next(iter(cfg.tenants), "default")
    token_file = cfg.path(cfg.tenants[tenant].token_file) if tenant in cfg.tenants else "?"
    # dpuctl in another terminal must find the same data directory (and so the agent)
    env = "" if cfg.agent.data_dir == "./var" else f"DPUKV_AGENT_DATA_DIR={cfg.data_dir} "
    opt = "" if cfg.source == "<defaults>" else f" --config {cfg.source}"
    nv = listener_for(cfg.spdk, tenant, "") if cfg.spdk is not None and cfg.spdk_mode else None
    nqn = nv["subnqn"] if nv else tenant_nqn(tenant)
    return f"""dpukv agent {cfg.agent.node_name} is serving (Ctrl-C stops it)
  control   {addr["control_tcp"]}  {addr["control_unix"]}
  NVMe/TCP  {addr["nvmf"]}  (subsystem {nqn})
  metrics   {addr["metrics"] or "disabled"}
  data      {cfg.data_dir}
  tenant    {tenant}, token in {token_file}

Try it (in another terminal):
  {env}.venv/bin/dpuctl status{opt}
  {env}.venv/bin/dpuctl stats --json{opt}
  .venv/bin/python - <<'PY'
import numpy as np
from host_shim import KVClient
from kvproto.keys import ChunkLayout
L = ChunkLayout("demo", "float16", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)
token = open("{token_file}").read().strip()
c = KVClient("{addr["control_tcp"]}", "{tenant}", token, L, salt=b"my-tenant-salt-16b")
tokens = list(range(64))
print("put", c.put(tokens, [np.full(L.chunk_shape, i, np.float16) for i in range(4)]))
out = [np.empty(L.chunk_shape, np.float16) for _ in range(4)]
print("get", c.get(tokens, out), "chunks; first value of chunk 3:", out[3].flat[0])
PY
"""


async def _serve(cfg: AgentConfig) -> int:
    agent = Agent(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
    except OSError as e:
        print(f"error: cannot start the agent: {e}. Is another agent running "
              "(dpuctl status)? Ports: [control] port, [nvmf] port, [metrics] port in the "
              "config, or DPUKV_CONTROL_PORT / DPUKV_NVMF_PORT / DPUKV_METRICS_PORT "
              "(0 picks a free one).", file=sys.stderr)  # fmt: skip
        await agent.stop()
        return 1
    except Exception as e:  # key file, journal, devices: say what, not a traceback
        print(f"error: cannot start the agent: {type(e).__name__}: {e}", file=sys.stderr)
        await agent.stop()
        return 1
    print(banner(cfg, agent.addresses()), flush=True)
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


def run_agent(cfg: AgentConfig) -> int:
    """Run in the foreground until SIGINT/SIGTERM; returns the process exit code."""
    configure_logging(level=cfg.agent.log_level, console=sys.stderr.isatty())
    return asyncio.run(_serve(cfg))


# --- an agent in a child process (tests, benchmarks, examples) ---------------------------------

SPAWN_TIMEOUT_S = 60.0  # first start builds tiers and the journal; on a loaded 2-core box


@dataclass(slots=True, kw_only=True)
class AgentProcess:
    """A `dpuctl agent run` child with its addresses (from its state file) and tokens."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    state: dict[str, Any]
    token: str = field(repr=False)
    admin_token: str = field(repr=False)

    @property
    def control_url(self) -> str:
        return str(self.state["control"]["tcp"])

    @property
    def unix_url(self) -> str:
        return str(self.state["control"]["unix"])

    @property
    def metrics_url(self) -> str:
        return str(self.state["metrics"])

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Signal the agent and wait; SIGKILL if it does not stop in time. Returns its code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def _read_optional(path: Path) -> str:
    """The default tenant's token; "" when a config without that tenant was used."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def spawn_agent(
    data_dir: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    config: str | os.PathLike[str] | None = None,
    timeout_s: float = SPAWN_TIMEOUT_S,
    netns: str | None = None,
) -> AgentProcess:
    """Start an agent on ephemeral loopback ports (unless `env` says otherwise) and wait for it;
    with `netns`, inside that network namespace (`ip netns exec`: the same process id)."""
    data = Path(data_dir).absolute()
    data.mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        "DPUKV_AGENT_DATA_DIR": str(data),
        "DPUKV_CONTROL_PORT": "0",
        "DPUKV_NVMF_PORT": "0",
        "DPUKV_METRICS_PORT": "0",
        **(env or {}),
    }
    state_path = data / "agent.json"
    with contextlib.suppress(FileNotFoundError):
        state_path.unlink()  # a stale one from a killed agent
    args = [sys.executable, "-c", "from dpu_agent.cli import main; main()", "agent", "run"]
    if config is not None:
        args += ["--config", str(config)]
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    with open(data / "agent.log", "ab") as out:
        proc = subprocess.Popen(args, env=child_env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (data / "agent.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"agent exited with {proc.returncode} while starting:\n{tail}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            state = json.loads(state_path.read_text())
            if state.get("pid") == proc.pid:
                return AgentProcess(
                    proc=proc, data_dir=data, state=state,
                    token=_read_optional(data / "tenant-default.token"),
                    admin_token=(data / "admin.token").read_text().strip(),
                )  # fmt: skip
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"agent did not start within {timeout_s} s; see {data / 'agent.log'}")
