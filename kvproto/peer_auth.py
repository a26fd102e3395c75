"""Cluster membership proofs: who is one of the cluster's own agents (docs/CLUSTER.md).

Every agent of a cluster holds the cluster's pre-shared key (PSK, `[cluster] peer_key_file`,
provisioned by the operator; several keys during a rotation: the first signs, any verifies).
Two proofs come from it, both HMAC-SHA256 (RFC 2104) and both pure functions here:

- The member tag: each agent publishes ``auth`` = MAC(PSK, its name and its MEMBER_TAGS)
  in Serf. A member whose tag does not verify is not placed, gets no chunk and no connection.
  It costs no traffic (gossip already carries the tags) and binds the name and the control
  address, so one node's tag copied onto another name or address does not verify.
- The peer handshake, on every agent-to-agent control connection: the connecting agent sends
  ``peer_challenge`` (its name, a fresh nonce); the agent answers with its name, its own nonce
  and a server proof over both nonces and both names; only if that verifies does the connecting
  agent send its client proof in ``hello`` (``peer_proof``, with the tenant it acts for by
  name, never a tenant token). Both sides prove the key, neither reveals it, and a recorded
  handshake cannot be replayed (each side's nonce is fresh).

No I/O here: the agent's dispatcher and dpu_agent.cluster call these.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = [
    "AUTH_TAG",
    "MEMBER_TAGS",
    "NONCE_BYTES",
    "PEER_KEYS_MAX",
    "PEER_KEY_BYTES_MIN",
    "PROOF_BYTES",
    "client_proof",
    "member_tag",
    "parse_peer_keys",
    "server_proof",
    "verify_member_tag",
    "verify_proof",
]

AUTH_TAG: Final = "auth"  # the Serf tag that carries the member proof
NONCE_BYTES: Final = 32
PROOF_BYTES: Final = 32  # a full HMAC-SHA256
# A member tag is truncated to 128 bits (22 base64 characters): Serf caps all of a node's tags
# at 512 bytes, and forging 128 bits needs 2^128 tries against an agent that only reads tags.
MEMBER_TAG_BYTES: Final = 16
PEER_KEY_BYTES_MIN: Final = 32  # characters of one key line: 32 random bytes base64 are 44
# Keys one file holds: a rotation needs two at once (new and old); 4 leaves room for a
# rotation started before the last one finished, and bounds the tries per proof.
PEER_KEYS_MAX: Final = 4

_MEMBER: Final = b"dpukv-member-v1\0"
_SERVER: Final = b"dpukv-peer-v1 server\0"
_CLIENT: Final = b"dpukv-peer-v1 client\0"


def parse_peer_keys(text: str) -> list[bytes]:
    """The keys of a peer key file: one per line (blank lines and # comments skipped), the
    first signs. ValueError saying what is wrong (never echoing a key)."""
    keys = [
        line.strip().encode()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ValueError("holds no key; put one per line (head -c 32 /dev/urandom | base64)")
    if len(keys) > PEER_KEYS_MAX:
        raise ValueError(f"holds {len(keys)} keys; at most {PEER_KEYS_MAX} (PEER_KEYS_MAX)")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < PEER_KEY_BYTES_MIN]
    if short:
        raise ValueError(
            f"key on non-comment line(s) {short} is shorter than {PEER_KEY_BYTES_MIN} "
            "characters; make one with: head -c 32 /dev/urandom | base64"
        )
    return keys


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:  # length-prefixed: no two part lists encode alike
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


# The tags a member's proof covers: everything placement and routing read but `state`,
# which changes through a node's life and says nothing about who it is. Other tags (another
# tool's, a benchmark's probe) are not ours to vouch for and change nothing here.
MEMBER_TAGS: Final = ("kv", "ctl", "nvme", "cap", "zone")


def _canonical(name: str, tags: Mapping[str, str]) -> list[bytes]:
    return [name.encode(), *(tags.get(k, "").encode() for k in MEMBER_TAGS)]


def member_tag(key: bytes, name: str, tags: Mapping[str, str]) -> str:
    """The ``auth`` tag for a member `name` publishing `tags` (MEMBER_TAGS of them)."""
    mac = _mac(key, _MEMBER, *_canonical(name, tags))[:MEMBER_TAG_BYTES]
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def verify_member_tag(keys: Sequence[bytes], name: str, tags: Mapping[str, str]) -> bool:
    """True when `tags` carry an ``auth`` tag made with one of `keys` for `name`."""
    got = tags.get(AUTH_TAG, "")
    return any(hmac.compare_digest(member_tag(k, name, tags), got) for k in keys)


def server_proof(key: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    return _mac(key, _SERVER, nonce_c, nonce_s, client.encode(), server.encode())


def client_proof(key: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    return _mac(key, _CLIENT, nonce_c, nonce_s, client.encode(), server.encode())


def verify_proof(
    keys: Sequence[bytes],
    proof: bytes,
    side: str,
    nonce_c: bytes,
    nonce_s: bytes,
    client: str,
    server: str,
) -> bool:
    """`proof` is `side`'s ("server" or "client") proof under one of `keys`."""
    assert side in ("server", "client"), side
    make = server_proof if side == "server" else client_proof
    return any(hmac.compare_digest(proof, make(k, nonce_c, nonce_s, client, server)) for k in keys)
