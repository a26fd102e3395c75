"""Agent-to-agent connections: the one place that opens them, and what refuses them.

Every connection one agent opens to another (hand-over, repair, anything new) goes through
`open_peer`: a data-plane client whose control session is opened with the peer handshake of
kvproto.peer_auth (the cluster PSK, mutual) for a tenant named, never with the tenant's token:
tokens stay on the node they were given to. A peer that cannot prove membership is never sent
a byte past the challenge; its refusal is logged (rate-limited) and counted in
``kvtier_cluster_peer_refused_total{reason}``, as are members refused for their tags
(dpu_agent.cluster._membership) and peers refused by this agent's dispatcher.
"""

from __future__ import annotations

import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.metrics import REGISTRY, Counter
from host_shim.client import AgentUnreachable, ControlChannel, ControlError, NodeClient
from kvproto.control import PROTOCOL_VERSION
from kvproto.keys import ChunkLayout
from kvproto.peer_auth import NONCE_BYTES, client_proof, verify_proof
from kvproto.placement import Node

__all__ = ["PEER_TIMEOUT_S", "PeerAuth", "PeerChannel", "open_peer", "refuse"]

log = get_logger("dpu_agent.cluster")
_refusals = RateLimitedLog(log)

# A peer's control round trip on a LAN is ~0.1 ms; a handshake or move taking 5 s means the
# peer is gone or overloaded, and the next pass retries.
PEER_TIMEOUT_S = 5.0
# The layout only sizes buffers for token-level calls; moves use key-level calls with the
# chunk's own length, so any layout works here.
_ANY_LAYOUT = ChunkLayout("peer", "uint8", 1, 1, 1, chunk_tokens=1)
_SALT = b"peer-calls-have-no-tokens"

PEER_REFUSED = Counter(
    "kvtier_cluster_peer_refused",
    "Members or connections refused for not proving cluster membership, by reason: member_tag "
    "(gossip lists it, its auth tag does not verify), bad_tag (malformed tags), server_proof "
    "(a peer we connected to failed the handshake), client_proof (a peer connecting here did), "
    "no_peer_tls_ca (a tls:// member and no CA here to verify it), tenant_incarnation (a "
    "peer acting for another incarnation of a tenant, removed and added again meanwhile).",
    ["reason"],
    registry=REGISTRY,
)


def refuse(reason: str, **fields: Any) -> None:
    """Count and log (rate-limited) one refusal."""
    PEER_REFUSED.labels(reason).inc()
    _refusals.warning("cluster_peer_refused", reason=reason, **fields)


@dataclass(frozen=True, slots=True)
class PeerAuth:
    """This agent's name, the cluster keys (the first signs, any verifies) and the TLS
    context for members whose control URL is tls:// (dpu_agent.control_tls.peer_client_context:
    None when no CA is configured)."""

    node: str
    keys: tuple[bytes, ...] = field(repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    # tenant -> the incarnation this node holds of it (tenants from etcd), None for a tenant
    # of the node's own config: a peer session names it and the receiver compares, so a node
    # that missed a remove and re-add of the name never moves one tenant's chunks into the other
    incarnation: Callable[[str], str | None] = field(default=lambda _t: None, compare=False)

    def __post_init__(self) -> None:
        assert self.keys, "a cluster needs at least one peer key"


class PeerChannel(ControlChannel):
    """A control session opened with the peer handshake instead of a token: the peer must
    prove the cluster key (and be `expect`, the member we meant) before we say anything else."""

    def __init__(
        self, url: str, tenant: str, auth: PeerAuth, expect: str, *, timeout_s: float
    ) -> None:
        super().__init__(url, tenant, "", timeout_s=timeout_s, client="dpukv-peer",
                         ssl_context=auth.tls)  # fmt: skip
        self._auth = auth
        self._expect = expect

    def connect(self) -> dict[str, Any]:
        if self.kind == "tls" and self._auth.tls is None:  # never the environment's defaults
            refuse("no_peer_tls_ca", member=self._expect, control=self.url)
            raise AgentUnreachable(
                f"peer {self._expect} at {self.url} is TLS and this agent has no CA to verify "
                "it: set [cluster] peer_tls_ca (or [control] tls_client_ca)"
            )
        with self._lock:
            self._close_locked()
            self._sock = self._open()
            try:
                return self._handshake()
            except AgentUnreachable:
                self._close_locked()
                raise
            except ControlError as e:  # a refusal of the frame: to the caller, a lost peer
                self._close_locked()
                raise AgentUnreachable(f"peer {self._expect} at {self.url}: {e}") from None
            except BaseException:
                self._close_locked()
                raise

    def _handshake(self) -> dict[str, Any]:
        auth, nonce_c = self._auth, secrets.token_bytes(NONCE_BYTES)
        (r,) = self._exchange(
            self._encode([("peer_challenge", {"node": auth.node, "nonce": nonce_c})])
        )
        if not r.ok:
            raise AgentUnreachable(f"peer {self._expect} at {self.url} refused: {r.message}")
        server, nonce_s, proof = r.result.get("node"), r.result.get("nonce"), r.result.get("proof")
        ok = (
            server == self._expect
            and isinstance(nonce_s, bytes)
            and len(nonce_s) == NONCE_BYTES
            and isinstance(proof, bytes)
            and verify_proof(auth.keys, proof, "server", nonce_c, nonce_s, auth.node, server)
        )
        if not ok:
            refuse("server_proof", member=self._expect, control=self.url, said=str(server)[:64])
            raise AgentUnreachable(
                f"{self.url} did not prove it is cluster member {self._expect}: nothing sent"
            )
        assert isinstance(nonce_s, bytes) and isinstance(server, str)
        mine = client_proof(auth.keys[0], nonce_c, nonce_s, auth.node, server)
        fields = {"version": PROTOCOL_VERSION, "tenant": self.tenant, "token": "",
                  "hostnqn": self.hostnqn, "client": self._client, "peer_proof": mine}  # fmt: skip
        incarnation = auth.incarnation(self.tenant)
        if incarnation is not None:
            fields["incarnation"] = incarnation
        (reply,) = self._exchange(self._encode([("hello", fields)]))
        if not reply.ok:  # the peer is a member but refuses (tenant unknown there, old key)
            raise AgentUnreachable(f"peer {server} refused {self.tenant}: {reply.message}")
        self.hello = dict(reply.result)
        return self.hello


class _PeerClient(NodeClient):
    """A node client whose session is a peer session (PeerChannel)."""

    def __init__(self, node: Node, tenant: str, auth: PeerAuth, *, timeout_s: float) -> None:
        super().__init__(node.control, tenant, "", _ANY_LAYOUT, _SALT, io_queues=1,
                         timeout_s=timeout_s)  # fmt: skip
        self._channel.close()
        self._channel = PeerChannel(node.control, tenant, auth, node.name, timeout_s=timeout_s)


def open_peer(
    node: Node, tenant: str, auth: PeerAuth, *, timeout_s: float = PEER_TIMEOUT_S
) -> NodeClient:
    """A data-plane client to member `node` acting for `tenant` (by name), authorised by the
    cluster key. It connects on first use; a peer that fails the handshake is a lost agent to
    the caller (misses, puts of 0), so nothing is ever handed to it or deleted because of it."""
    return _PeerClient(node, tenant, auth, timeout_s=timeout_s)
