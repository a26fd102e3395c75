"""KVClient's NIXL data path and the choice between it and NVMe/TCP.

`choose_transport` is the decision table (pure); `NixlDataPath` speaks the control-plane ops
(kvproto.control: nixl_connect, nixl_register, nixl_get, nixl_put) around a NixlHostPath.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from host_shim.transport._lib import NixlUnavailable, nixl_status
from host_shim.transport._nixl import BufferDesc, NixlHostPath, buffer_desc

__all__ = ["TRANSPORTS", "NixlDataPath", "Transport", "TransportSelector", "choose_transport"]

log = logging.getLogger("host_shim.transport")

Transport = Literal["nixl", "nvme-tcp", "auto"]
TRANSPORTS: tuple[str, ...] = ("nixl", "nvme-tcp", "auto")


class _Channel(Protocol):
    def call(self, op: str, **fields: Any) -> dict[str, Any]: ...


def choose_transport(
    wanted: str, host_nixl: dict[str, Any], agent_nixl: dict[str, Any] | None
) -> tuple[str, str]:
    """(transport, why) for a client that asked for `wanted`, given what this host's NIXL load
    said (`nixl_status()`) and what the agent's hello said (None: the agent predates NIXL)."""
    assert wanted in TRANSPORTS, wanted
    if wanted == "nvme-tcp":
        return "nvme-tcp", "asked for nvme-tcp"
    if not host_nixl.get("available"):
        return "nvme-tcp", f"NIXL unavailable on this host: {host_nixl.get('reason', '?')}"
    if not agent_nixl:
        return "nvme-tcp", "the agent does not offer NIXL (its hello has no nixl entry)"
    if not agent_nixl.get("available"):
        return "nvme-tcp", f"NIXL unavailable on the agent: {agent_nixl.get('reason', '?')}"
    return "nixl", f"NIXL on both sides ({host_nixl.get('module')}, UCX)"


class NixlDataPath:
    """The NIXL data path of one KVClient (created once, re-attached after each reconnect)."""

    def __init__(self, tenant: str) -> None:
        self.host = NixlHostPath(tenant)

    @staticmethod
    def status() -> dict[str, Any]:
        return nixl_status()

    def attach(self, channel: _Channel) -> str:
        """A new control session: hand the agent our metadata and every registered region."""
        res = channel.call("nixl_connect", metadata=self.host.metadata())
        self.host.agent_name = str(res["agent"])
        regions = self.host.regions()
        if regions:
            channel.call("nixl_register", metadata=self.host.metadata(), add=regions, drop=[])
        return self.host.agent_name

    def _register(self, channel: _Channel, descs: Sequence[BufferDesc]) -> None:
        added, dropped = self.host.prepare(descs)
        if added or dropped:
            channel.call("nixl_register", metadata=self.host.metadata(), add=added, drop=dropped)
            self.host.commit()

    def get(self, channel: _Channel, keys: list[bytes], into: Sequence[Any], nbytes: int) -> int:
        """The agent WRITEs the cached prefix of `keys` into `into`; leading chunks loaded
        (verified by the agent before it counts them)."""
        descs = [buffer_desc(b, nbytes, writable=True) for b in into[: len(keys)]]
        self._register(channel, descs)
        res = channel.call("nixl_get", keys=keys, targets=[[d.addr, d.nbytes] for d in descs])
        return int(res["loaded"])

    def put(
        self,
        channel: _Channel,
        keys: list[bytes],
        parents: Sequence[bytes | None],
        chunks: Sequence[Any],
        nbytes: int,
    ) -> int:
        """The agent READs `chunks` and stores them under `keys`; leading chunks stored."""
        descs = [buffer_desc(c, nbytes, writable=False) for c in chunks[: len(keys)]]
        self._register(channel, descs)
        res = channel.call("nixl_put", keys=keys, parents=list(parents),
                           sources=[[d.addr, d.nbytes] for d in descs])  # fmt: skip
        return int(res["stored"])

    def close(self) -> None:
        self.host.close()


class TransportSelector:
    """Which data path a KVClient uses, decided at each connect and said once in the log.

    `transport`: "nvme-tcp" or "nixl" once connected ("" before); `reason` says why.
    """

    def __init__(self, wanted: str, tenant: str) -> None:
        if wanted not in TRANSPORTS:
            raise ValueError(f"transport {wanted!r}: choose one of {', '.join(TRANSPORTS)}")
        self.wanted, self.tenant = wanted, tenant
        self.path: NixlDataPath | None = None
        self.active = False
        self.transport, self.reason = "", ""
        self._said = ""

    def attach(
        self, channel: _Channel, hello: dict[str, Any], lost: tuple[type[Exception], ...]
    ) -> None:
        """A new control session: use NIXL when wanted and both sides have it, else NVMe/TCP.
        Errors in `lost` (the agent went away) propagate; any other refusal falls back."""
        self.active = False
        transport, why = choose_transport(self.wanted, nixl_status(), hello.get("nixl"))
        if transport == "nixl":
            try:
                if self.path is None:
                    self.path = NixlDataPath(self.tenant)
                agent = self.path.attach(channel)
                self.active, why = True, f"{why}; agent {agent}"
            except (NixlUnavailable, RuntimeError, OSError) as e:  # UCX failed to start
                transport, why = "nvme-tcp", f"NIXL failed: {type(e).__name__}: {e}"
            except Exception as e:  # the agent refused (ControlError): same fallback
                if isinstance(e, lost):
                    raise
                transport, why = "nvme-tcp", f"the agent refused NIXL: {e}"
        self._settle(transport, why, warn=self.wanted == "nixl" and transport != "nixl")

    def fail(self, e: Exception) -> None:
        """A NIXL op failed on a live session: NVMe/TCP until the next connect."""
        self.active = False
        self._settle("nvme-tcp", f"NIXL transfer failed: {e}", warn=True)

    def _settle(self, transport: str, why: str, *, warn: bool) -> None:
        self.transport, self.reason = transport, why
        if why != self._said:  # once per change, not per reconnect
            log.log(
                logging.WARNING if warn else logging.INFO,
                "kvclient: data path %s (%s)",
                transport,
                why,
            )
            self._said = why

    def close(self) -> None:
        if self.path is not None:
            self.path.close()
