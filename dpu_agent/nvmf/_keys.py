"""Issued host keys: the agent, not the operator, makes each host's data-path secrets.

When a subsystem requires authentication (`[nvmf] require_auth`) or a secure channel
(`[nvmf] secure_channel`), the agent generates a DH-HMAC-CHAP secret (`DHHC-1:01:`, 32 random
bytes, transformed with SHA-256) and/or a TLS PSK (`NVMeTLSkey-1:01:`) for a host the first
time it is seen: when the host says hello on the control plane with the tenant's token, or when
an operator runs `dpuctl hosts add --tenant T --nqn N`. The keys are bound to that tenant's
subsystem only (another tenant's subsystem knows nothing of them), kept in `host_keys.json`
in the data directory (mode 0600) so a restart keeps them, and handed to the host in the hello
reply, so the shim connects with them.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from dpu_agent.nvmf._auth import HostKeys, host_keys_from_dict, host_keys_to_dict
from dpu_agent.nvmf._subsystem import Subsystem
from kvproto.nvme import DhchapHash, DhchapSecret, TlsPsk

__all__ = ["HOST_KEYS_FILE", "HOST_KEYS_PER_TENANT_MAX", "HostKeyIssuer"]

HOST_KEYS_FILE = "host_keys.json"
HOST_KEYS_PER_TENANT_MAX = 4096  # as HOSTS_PER_TENANT_MAX: a fleet of GPU servers per tenant
_ANY_ADDRESS = "any_address"  # in a host's entry: an operator added it (allowed after restarts)


class HostKeyIssuer:
    """Issues, remembers and binds keys per (tenant, host NQN)."""

    def __init__(self, path: str | os.PathLike[str], *, dhchap: bool, psk: bool) -> None:
        self.path = Path(path)
        self.dhchap, self.psk = dhchap, psk
        self._lock = threading.Lock()
        self._keys: dict[str, dict[str, HostKeys]] = {}  # tenant -> host -> keys
        # tenant -> hosts an operator added: allowed from any address, across restarts
        self._any_address: dict[str, set[str]] = {}
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            self._keys = {
                t: {h: host_keys_from_dict(k) for h, k in hosts.items()} for t, hosts in raw.items()
            }
            self._any_address = {
                t: {h for h, k in hosts.items() if k.get(_ANY_ADDRESS)} for t, hosts in raw.items()
            }

    @property
    def enabled(self) -> bool:
        return self.dhchap or self.psk

    def bind(self, tenant: str, sub: Subsystem) -> None:
        """Put the tenant's remembered keys on its subsystem (at start). Hosts an operator
        added (`dpuctl hosts add`) are allowed again, from any address, as before the restart;
        a host whose keys a hello issued is allowed nowhere until a live control session binds
        it again (with that session's address): its NQN alone, from anywhere, is no
        credential, and the shim says hello again when it reconnects."""
        for host, keys in self._keys.get(tenant, {}).items():
            sub.host_keys[host] = keys
            if host in self._any_address.get(tenant, ()):
                sub.allowed_hosts.add(host)

    def issue(
        self, tenant: str, sub: Subsystem, hostnqn: str, *, any_address: bool = False
    ) -> HostKeys:
        """The host's keys on this tenant's subsystem: the remembered ones, else new ones.
        Who may connect is the caller's business (a session's binding, or the operator's
        `hosts add`); `any_address`: an operator added it, so `bind` allows it again after a
        restart."""
        with self._lock:
            hosts = self._keys.setdefault(tenant, {})
            keys = hosts.get(hostnqn)
            wanted = (self.dhchap, self.psk)
            operators = self._any_address.setdefault(tenant, set())
            changed = any_address and hostnqn not in operators
            if keys is None or ((keys.dhchap_key is not None, keys.psk is not None) != wanted):
                if len(hosts) >= HOST_KEYS_PER_TENANT_MAX and hostnqn not in hosts:
                    oldest = next(iter(hosts))  # insertion order: the first issued goes
                    del hosts[oldest]
                    operators.discard(oldest)
                    sub.host_keys.pop(oldest, None)
                keys = HostKeys(
                    dhchap_key=DhchapSecret.generate(DhchapHash.SHA256) if self.dhchap else None,
                    psk=TlsPsk.generate(DhchapHash.SHA256) if self.psk else None,
                )
                hosts[hostnqn] = keys
                changed = True
            if any_address:
                operators.add(hostnqn)
            if changed:
                self._save()
            sub.host_keys[hostnqn] = keys
            return keys

    def hosts(self, tenant: str) -> dict[str, dict[str, Any]]:
        """The tenant's hosts with keys: which keys each holds, and whether an operator added
        it (no secrets)."""
        with self._lock:
            return {
                h: {
                    "keys": sorted(host_keys_to_dict(k)),
                    "operator_added": h in self._any_address.get(tenant, ()),
                }
                for h, k in self._keys.get(tenant, {}).items()
            }

    def forget_host(self, tenant: str, hostnqn: str) -> bool:
        """Revoke the host's keys; True when it had some."""
        with self._lock:
            self._any_address.get(tenant, set()).discard(hostnqn)
            if self._keys.get(tenant, {}).pop(hostnqn, None) is None:
                return False
            self._save()
            return True

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            self._any_address.pop(tenant, None)
            if self._keys.pop(tenant, None) is not None:
                self._save()

    def _marks(self, tenant: str, host: str) -> dict[str, bool]:
        return {_ANY_ADDRESS: True} if host in self._any_address.get(tenant, ()) else {}

    def _save(self) -> None:
        data = {
            t: {h: {**host_keys_to_dict(k), **self._marks(t, h)} for h, k in hs.items()}
            for t, hs in self._keys.items()
        }
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def hello_keys(keys: HostKeys) -> dict[str, str]:
    """What the hello reply's `nvme` section adds for the shim."""
    return host_keys_to_dict(keys)
