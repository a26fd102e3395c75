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
import time
from pathlib import Path
from typing import Any

from dpu_agent.log import get_logger
from dpu_agent.nvmf._host_keys import (
    HostKeys,
    host_keys_from_dict,
    host_keys_to_dict,
    nqn_hash,
)
from dpu_agent.nvmf._subsystem import Subsystem
from kvproto.nvme import DhchapHash, DhchapSecret, TlsPsk

__all__ = ["HOST_KEYS_FILE", "HOST_KEYS_PER_TENANT_MAX", "HostKeyBudgetExceeded", "HostKeyIssuer"]

log = get_logger(__name__)

HOST_KEYS_FILE = "host_keys.json"
# Keys one tenant holds (each tenant its own budget: no tenant's hosts touch another's). As
# HOSTS_PER_TENANT_MAX: a fleet of GPU servers per tenant. At the budget, a new host takes the
# slot of the oldest key no live control session uses (that host gets a new key at its next
# hello); when every key is in use or was added by the operator, the new host is refused.
HOST_KEYS_PER_TENANT_MAX = 4096
_ANY_ADDRESS = "any_address"  # in a host's entry: an operator added it (allowed after restarts)
# Writes of the key file are batched: changes within this window go out in one write, in a
# writer thread. Hello-issued keys need not be durable before the reply (a host gets its key
# again at every hello); operator-added ones are (`flush()` before `dpuctl hosts add` answers).
HOST_KEYS_WRITE_INTERVAL_S = 0.2


class HostKeyBudgetExceeded(ValueError):
    """The tenant holds HOST_KEYS_PER_TENANT_MAX keys, all in use or added by the operator."""


class HostKeyIssuer:
    """Issues, remembers and binds keys per (tenant, host NQN); writes the file off the caller's
    thread, batched (`flush()` waits for it)."""

    def __init__(self, path: str | os.PathLike[str], *, dhchap: bool, psk: bool) -> None:
        self.path = Path(path)
        self.dhchap, self.psk = dhchap, psk
        self._lock = threading.Lock()  # the maps below
        self._write_lock = threading.Lock()  # one writer of the file at a time
        self._keys: dict[str, dict[str, HostKeys]] = {}  # tenant -> host -> keys (oldest first)
        self._docs: dict[str, dict[str, dict[str, Any]]] = {}  # the same, as the file has them
        self._version = 0  # changes made
        self._written = 0  # changes on disk
        self._wake = threading.Event()
        self._closed = False
        self._writer: threading.Thread | None = None
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            for t, hosts in raw.items():
                self._keys[t] = {h: host_keys_from_dict(k) for h, k in hosts.items()}
                self._docs[t] = {h: dict(k) for h, k in hosts.items()}

    @property
    def enabled(self) -> bool:
        return self.dhchap or self.psk

    def bind(self, tenant: str, sub: Subsystem) -> None:
        """Put the tenant's remembered keys on its subsystem (at start). Hosts an operator
        added (`dpuctl hosts add`) are allowed again, from any address, as before the restart;
        a host whose keys a hello issued is allowed nowhere until a live control session binds
        it again (with that session's address): its NQN alone, from anywhere, is no
        credential, and the shim says hello again when it reconnects."""
        docs = self._docs.get(tenant, {})
        for host, keys in self._keys.get(tenant, {}).items():
            sub.host_keys[host] = keys
            if keys.psk is not None and keys.psk.spdk_takes_for_none(host, sub.nqn):
                log.warning(  # a key issued before TlsPsk.generate drew such keys again
                    "nvmf_host_psk_spdk_plaintext", tenant=tenant, host=nqn_hash(host),
                    hint="SPDK's initiator connects without TLS with this key (its derived "
                    "PSK begins 0x00; docs/NVME_AUTH.md): `dpuctl hosts remove` and `hosts "
                    "add` it again for a new key",
                )  # fmt: skip
            if docs.get(host, {}).get(_ANY_ADDRESS):
                sub.allowed_hosts.add(host)

    def issue(
        self, tenant: str, sub: Subsystem, hostnqn: str, *, any_address: bool = False
    ) -> HostKeys:
        """The host's keys on this tenant's subsystem: the remembered ones, else new ones.
        Who may connect is the caller's business (a session's binding, or the operator's
        `hosts add`); `any_address`: an operator added it, so `bind` allows it again after a
        restart, and it is never evicted. Raises HostKeyBudgetExceeded when the tenant is at
        its budget and no key can make room."""
        with self._lock:
            hosts = self._keys.setdefault(tenant, {})
            docs = self._docs.setdefault(tenant, {})
            keys = hosts.get(hostnqn)
            wanted = (self.dhchap, self.psk)
            # the operator adding a host a hello was issued keys for: new keys (any holder of
            # the tenant's token could have said hello with that NQN, which is no secret, and
            # kept its key past a rotation as an operator's host: an attack pass)
            rekey = any_address and not docs.get(hostnqn, {}).get(_ANY_ADDRESS)
            if (
                rekey
                or keys is None
                or ((keys.dhchap_key is not None, keys.psk is not None) != wanted)
            ):
                if hostnqn not in hosts and len(hosts) >= HOST_KEYS_PER_TENANT_MAX:
                    self._make_room(tenant, sub)
                keys = HostKeys(
                    dhchap_key=DhchapSecret.generate(DhchapHash.SHA256) if self.dhchap else None,
                    psk=TlsPsk.generate(hostnqn, sub.nqn) if self.psk else None,
                )
                hosts.pop(hostnqn, None)
                hosts[hostnqn] = keys
                doc: dict[str, Any] = host_keys_to_dict(keys)
                if any_address or docs.pop(hostnqn, {}).get(_ANY_ADDRESS):
                    doc[_ANY_ADDRESS] = True
                docs[hostnqn] = doc
                self._changed()
            else:  # seen again: the newest, so the last to make room
                hosts[hostnqn] = hosts.pop(hostnqn)
            sub.host_keys[hostnqn] = keys
            return keys

    def _make_room(self, tenant: str, sub: Subsystem) -> None:
        """Drop the tenant's oldest key that no live session binds and no operator added."""
        hosts, docs = self._keys[tenant], self._docs[tenant]
        for host in hosts:
            if host not in sub.host_peers and not docs.get(host, {}).get(_ANY_ADDRESS):
                del hosts[host]
                docs.pop(host, None)
                sub.host_keys.pop(host, None)
                sub.allowed_hosts.discard(host)
                return
        raise HostKeyBudgetExceeded(
            f"tenant {tenant!r} holds {HOST_KEYS_PER_TENANT_MAX} host keys "
            "(HOST_KEYS_PER_TENANT_MAX), each in use by a connected host or added by the "
            "operator; close some clients first"
        )

    def hosts(self, tenant: str) -> dict[str, dict[str, Any]]:
        """The tenant's hosts with keys: which keys each holds, and whether an operator added
        it (no secrets)."""
        with self._lock:
            return {
                h: {
                    "keys": sorted(host_keys_to_dict(k)),
                    "operator_added": bool(self._docs.get(tenant, {}).get(h, {}).get(_ANY_ADDRESS)),
                }
                for h, k in self._keys.get(tenant, {}).items()
            }

    def forget_host(self, tenant: str, hostnqn: str) -> bool:
        """Revoke the host's keys; True when it had some."""
        with self._lock:
            self._docs.get(tenant, {}).pop(hostnqn, None)
            if self._keys.get(tenant, {}).pop(hostnqn, None) is None:
                return False
            self._changed()
            return True

    def forget_session_hosts(self, tenant: str) -> list[str]:
        """Revoke every key a hello issued for the tenant (not the operator's): at a token
        rotation, so a leaked token's keys end with it. The hosts that lost keys."""
        with self._lock:
            docs = self._docs.get(tenant, {})
            gone = [h for h in self._keys.get(tenant, {}) if not docs.get(h, {}).get(_ANY_ADDRESS)]
            for h in gone:
                del self._keys[tenant][h]
                docs.pop(h, None)
            if gone:
                self._changed()
            return gone

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            self._docs.pop(tenant, None)
            if self._keys.pop(tenant, None) is not None:
                self._changed()

    def _changed(self) -> None:
        """A change to write (the caller holds _lock): the writer thread takes it."""
        self._version += 1
        if self._writer is None and not self._closed:
            self._writer = threading.Thread(target=self._write_loop, name="host-keys-writer",
                                            daemon=True)  # fmt: skip
            self._writer.start()
        self._wake.set()

    def _write_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.flush()
            except OSError as e:  # the keys stay in memory; the next change retries
                log.error("host_keys_write_failed", path=str(self.path), error=str(e))
            time.sleep(HOST_KEYS_WRITE_INTERVAL_S)  # what comes meanwhile goes in the next write

    def flush(self) -> None:
        """Write every change made so far to the file (0600, fsync, rename); raises OSError."""
        with self._write_lock:
            with self._lock:
                version = self._version
                if version == self._written:
                    return
                snapshot = {t: dict(hs) for t, hs in self._docs.items()}  # shallow: fast
            data = json.dumps(snapshot).encode()
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            with self._lock:
                self._written = max(self._written, version)

    def close(self) -> None:
        """Write what is pending and stop the writer thread."""
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(5)
            self._writer = None
        self.flush()


def hello_keys(keys: HostKeys) -> dict[str, str]:
    """What the hello reply's `nvme` section adds for the shim."""
    return host_keys_to_dict(keys)
