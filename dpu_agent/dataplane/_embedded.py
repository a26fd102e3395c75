"""Embedded mode: the agent's own NVMe/TCP target exports the engine's tiers (docs/NVME_TCP.md).

Each tenant is one subsystem with the tenant's namespaces. A host NQN is allowed on it only
while a control session that said hello with it lives (from that session's peer address), or
after an operator's `dpuctl hosts add`; with `[nvmf] require_auth` / `secure_channel` each
host gets issued DH-HMAC-CHAP secrets / TLS PSKs (docs/NVME_AUTH.md).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from dpu_agent.config import AgentConfig
from dpu_agent.control import Session
from dpu_agent.engine import Engine, EngineConfig, LimitExceeded, UnknownTenant
from dpu_agent.log import get_logger, nqn_tag
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, TargetOptions, tenant_nqn
from dpu_agent.nvmf._keys import HOST_KEYS_FILE, HostKeyIssuer, hello_keys
from kvproto.control import ErrorCode, RemoteProtocolError

__all__ = ["HOSTS_PER_TENANT_MAX", "EmbeddedDataPlane"]

log = get_logger("dpu_agent.service")  # host_bound, host_added...: events of the agent service

# Host NQNs allowed per subsystem at once (each bound to a live control session): a fleet of
# GPU servers. Beyond it a hello is refused; nobody else's entry is pushed out.
HOSTS_PER_TENANT_MAX = 4096
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1"})  # where a Unix-socket client's NVMe/TCP comes from


class EmbeddedDataPlane:
    """The DataPlane of `[agent] mode = "embedded"`."""

    offers_nixl = True

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self._engine: Engine | None = None
        self._target: NvmeTcpTarget | None = None
        self._subsystems: dict[str, Subsystem] = {}
        # tenant -> host NQN -> {control session id: its peer address}: an allowlist entry
        # lives exactly as long as a session that bound it (bind_host / session_closed)
        self._bindings: dict[str, dict[str, dict[int, str]]] = {}
        # tenant -> the host NQNs an operator added (`hosts add`): allowed from anywhere, never
        # bound to nor unbound by a control session
        self._operator: dict[str, set[str]] = {}
        self._overcommitted = False  # storage_overcommitted logged, not fitting since
        self.host_keys = HostKeyIssuer(  # issued DH-HMAC-CHAP secrets / TLS PSKs per host
            cfg.path(HOST_KEYS_FILE), dhchap=cfg.nvmf.require_auth, psk=cfg.nvmf.secure_channel
        )

    # --- lifecycle --------------------------------------------------------------------------
    async def open_engine(self, config: EngineConfig) -> Engine:
        self._engine = Engine(config)
        return self._engine

    async def start(self) -> None:
        cfg = self.cfg
        subsystems = [self._subsystem(name) for name in cfg.tenants]
        options = TargetOptions(
            max_io_size=cfg.nvmf.max_io_size,
            io_workers=cfg.nvmf.io_workers,
            data_buffers_per_queue=cfg.nvmf.data_buffers_per_queue,
        )
        self._target = NvmeTcpTarget(
            subsystems,
            cfg.nvmf.host,
            cfg.nvmf.port,
            options=options,
            secure_channel=cfg.nvmf.secure_channel,
        )
        await self._target.start()
        self.check_overcommit()

    def check_overcommit(self) -> int:
        """Warn when the tenants' NVMe tier files (sparse, each growing to [storage]
        nvme_bytes) could outgrow the file system under them: a full disk fails every
        tenant's puts. What they may still grow by minus the free space (0: they fit)."""
        root = self.cfg.path(self.cfg.storage.nvme_dir)
        grow = 0
        for tenant in self._subsystems:
            path = root / tenant / "nvme.img"
            try:
                held = path.stat().st_blocks * 512
            except OSError:
                held = 0
            grow += max(0, self.cfg.storage.nvme_bytes - held)
        try:
            st = os.statvfs(root)
        except OSError:
            return 0
        short = grow - st.f_bavail * st.f_frsize
        if short > 0 and not self._overcommitted:  # once, until it fits again
            log.warning("storage_overcommitted", nvme_dir=str(root), tenants=len(self._subsystems),
                        may_grow_bytes=grow, free_bytes=st.f_bavail * st.f_frsize,
                        fix="lower [storage] nvme_bytes, or give nvme_dir a larger file system: "
                            "a full disk fails every tenant's puts")  # fmt: skip
        self._overcommitted = short > 0
        return max(0, short)

    async def stop(self) -> None:
        if self._target is not None:
            await self._target.stop()

    async def close(self) -> None:
        self._engine = None
        await asyncio.to_thread(self.host_keys.close)  # issued keys pending a batched write

    @property
    def target(self) -> NvmeTcpTarget:
        assert self._target is not None, "start() first"
        return self._target

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "open_engine() first"
        return self._engine

    def _subsystem(self, tenant: str) -> Subsystem:
        """The tenant's subsystem: its namespaces only, reachable only by hosts it said hello
        from (hello_nvme adds each authenticated client's host NQN)."""
        sub = Subsystem(nqn=tenant_nqn(tenant), namespaces=self.engine.namespaces(tenant))
        sub.require_auth = self.cfg.nvmf.require_auth
        sub.secure_channel = self.cfg.nvmf.secure_channel
        sub.write_gate = self.engine.write_gate(tenant)  # only inside open reservations
        self.host_keys.bind(tenant, sub)
        self._subsystems[tenant] = sub
        self._bindings[tenant] = {}
        self._operator[tenant] = {
            h for h, row in self.host_keys.hosts(tenant).items() if row["operator_added"]
        }
        return sub

    # --- addresses --------------------------------------------------------------------------
    def address(self) -> str:
        return f"{self.target.host}:{self.target.port}"

    def subsystem_nqn(self, tenant: str) -> str:
        return tenant_nqn(tenant)

    def hello_nvme(self, tenant: str, hostnqn: str | None, local_host: str) -> dict[str, Any]:
        host, port = self.target.host, self.target.port
        if host in ("0.0.0.0", "::", ""):  # a wildcard bind: the address the client reached
            host = local_host
        nvme: dict[str, Any] = {"host": host, "port": port, "subnqn": tenant_nqn(tenant)}
        if hostnqn and self.host_keys.enabled:  # keys are issued, not invented
            nvme.update(hello_keys(self.host_keys.issue(tenant, self._subsystems[tenant], hostnqn)))
        return nvme

    # --- hosts ------------------------------------------------------------------------------
    def bind_host(self, session: Session, hostnqn: str) -> None:
        hosts = self._bindings.get(session.tenant)
        if hosts is None:
            raise UnknownTenant(f"tenant {session.tenant!r} has no subsystem")
        if hostnqn in self._operator.get(session.tenant, ()):
            # a session bound it, gave out its keys, and unbound it (the kernel host cut
            # off) at its close: any client of the tenant could take a kernel host's keys
            raise RemoteProtocolError(
                f"host NQN {hostnqn[:64]!r} was added by the operator (dpuctl hosts add) for "
                "a kernel initiator: a control session cannot claim it; leave hostnqn unset "
                "(the client makes its own)",
                ErrorCode.FORBIDDEN,
            )
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
        if session.hostnqn in self._operator.get(session.tenant, ()):
            sub.host_peers.pop(session.hostnqn, None)  # added meanwhile: from anywhere, kept
            return
        sub.allowed_hosts.discard(session.hostnqn)
        sub.host_peers.pop(session.hostnqn, None)
        if self._target is not None:  # its data-path connections end with it
            self._target.disconnect_host(sub.nqn, session.hostnqn)
        log.info("host_unbound", tenant=session.tenant, host=nqn_tag(session.hostnqn))

    def token_rotated(self, tenant: str) -> dict[str, Any]:
        """The keys hellos issued with the old token are revoked (their controllers cut off);
        the next hello issues new ones. Operator-added hosts keep theirs: no hello hands
        them out."""
        sub = self._subsystems.get(tenant)
        gone = self.host_keys.forget_session_hosts(tenant)
        for nqn in gone:
            if sub is not None:
                sub.host_keys.pop(nqn, None)
                if nqn not in self._bindings.get(tenant, {}):
                    sub.allowed_hosts.discard(nqn)
                    sub.host_peers.pop(nqn, None)
                if self._target is not None:
                    self._target.disconnect_host(sub.nqn, nqn)
        return {"host_keys_revoked": len(gone)}

    def _apply_host(self, tenant: str, hostnqn: str) -> None:
        sub = self._subsystems[tenant]
        addresses: set[str] = set()
        for peer in self._bindings[tenant][hostnqn].values():
            addresses |= {peer} if peer else LOOPBACK_HOSTS  # "": the Unix socket
        sub.allowed_hosts.add(hostnqn)
        sub.host_peers[hostnqn] = frozenset(addresses)

    def host_add(self, tenant: str, nqn: str) -> dict[str, Any]:
        """An operator-added host: allowed from any address while the tenant exists, not
        bound to a control session; with `[nvmf] require_auth` it must still prove its issued
        secret (without it, its NQN is all it shows)."""
        sub = self._subsystems[tenant]
        operator = self._operator.setdefault(tenant, set())
        rekeyed = nqn in sub.host_keys and nqn not in operator  # a hello's keys: replaced
        sub.allowed_hosts.add(nqn)
        sub.host_peers.pop(nqn, None)
        operator.add(nqn)
        keys = {}
        if self.host_keys.enabled:
            keys = hello_keys(self.host_keys.issue(tenant, sub, nqn, any_address=True))
        if rekeyed and self._target is not None:  # controllers on the old key end
            self._target.disconnect_host(sub.nqn, nqn)
        log.info("host_added", tenant=tenant, keys=sorted(keys))
        return {"tenant": tenant, "hostnqn": nqn, "subnqn": tenant_nqn(tenant), **keys}

    def host_list(self, tenant: str) -> dict[str, Any]:
        """Hosts with issued keys, allowed or bound to a session."""
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

    def host_remove(self, tenant: str, nqn: str, end_sessions: Callable[[], int]) -> dict[str, Any]:
        sub = self._subsystems[tenant]
        known = nqn in sub.allowed_hosts or nqn in self._bindings.get(tenant, {})
        revoked = self.host_keys.forget_host(tenant, nqn)
        if not (known or revoked):
            raise LookupError(f"no host {nqn[:64]!r} on tenant {tenant!r}; see dpuctl hosts list")
        ended = end_sessions()
        self._bindings.get(tenant, {}).pop(nqn, None)
        self._operator.get(tenant, set()).discard(nqn)
        sub.allowed_hosts.discard(nqn)
        sub.host_peers.pop(nqn, None)
        sub.host_keys.pop(nqn, None)
        self.target.disconnect_host(sub.nqn, nqn)
        log.info("host_removed", tenant=tenant, host=nqn_tag(nqn), sessions_ended=ended)
        return {"tenant": tenant, "hostnqn": nqn, "keys_revoked": revoked, "sessions_ended": ended}

    def flush_keys(self) -> None:
        self.host_keys.flush()

    # --- tenants ----------------------------------------------------------------------------
    def check_addable(self, tenant: str) -> None:
        """Any tenant can be added: its tiers are files and memory of this agent."""

    def add_tenant(self, tenant: str) -> None:
        self.target.add_subsystem(self._subsystem(tenant))
        self.check_overcommit()

    def remove_tenant(self, tenant: str) -> dict[str, Any]:
        """Remove its subsystem (its hosts are disconnected) and keys, and crypto-erase its
        tiers."""
        if self._target is not None:
            self._target.remove_subsystem(tenant_nqn(tenant))
        self._subsystems.pop(tenant, None)
        self.host_keys.forget_tenant(tenant)
        self._bindings.pop(tenant, None)
        self._operator.pop(tenant, None)
        return self.engine.remove_tenant(tenant)

    def unconfigured(self, held: set[str], configured: set[str]) -> list[str]:
        return sorted(held - configured)

    def check_backup(self, op: str) -> None:
        """Backups hold the tiers' ciphertext and the journal: always possible here."""
