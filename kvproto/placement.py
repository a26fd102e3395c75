"""Chunk placement: weighted rendezvous hashing over the serving members of the cluster.

Every node and every client computes the owners of a key from the same member list, so a
lookup goes straight to an owner: no directory, no hop. For each (key, node) pair a 64-bit
score h = mix64(key64 ^ seed(node)) is turned into u in (0, 1) and the node's weight w
(capacity) into the rendezvous score -w / ln(u) (Schindelhauer and Schomaker's weighted
form): a node takes a share of keys proportional to its weight, and when a node joins or
leaves only the keys it gains or loses move (the minimum, 1/N on average). With equal
weights the score's order is the order of h itself, so the batch path skips the logarithm.

Replicas: the R best-scoring nodes; when members carry zones, the R best zones first (each
with its best node), then the best remaining nodes if there are fewer zones than R.

The membership epoch is a hash of the sorted member list (names, addresses, capacity, zone,
state): two views with the same epoch place every key alike. Requests carry it; a node whose
epoch differs answers `moved` and the client reads the member list again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvproto.control import REPLICAS_MAX

__all__ = [
    "NODE_STATES",
    "REPLICAS_MAX",
    "Node",
    "Placement",
    "key64",
    "keys64",
    "membership_epoch",
]

NODE_STATES: Final = ("joining", "serving", "leaving")
# Cells of the [keys x nodes] score matrix per numpy pass: 256 KiB temporaries stay in cache
# (3-4 ns a cell here at 1,024 nodes, 4x faster than 64 MiB passes).
SCORE_CELLS_MAX: Final = 1 << 15

_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S11: Final = np.uint64(11)
_INV53: Final = 1.0 / float(1 << 53)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array (a bijection with full avalanche)."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def key64(key: bytes) -> int:
    """The first 8 bytes of a chunk key (already a cryptographic hash) as an integer."""
    return int.from_bytes(key[:8], "little")


def keys64(keys: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8").astype(np.uint64)


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One member as placement sees it (from its Serf tags)."""

    name: str
    control: str = ""  # tcp://host:port of its control plane
    nvme: str = ""  # host:port of its NVMe/TCP listener
    capacity_bytes: int = 1
    zone: str = ""
    state: str = "serving"

    def __post_init__(self) -> None:
        assert self.name, "a node needs a name"
        assert self.capacity_bytes > 0, self.capacity_bytes
        assert self.state in NODE_STATES, self.state

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "control": self.control, "nvme": self.nvme,
                "capacity_bytes": self.capacity_bytes, "zone": self.zone,
                "state": self.state}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Node:
        return cls(
            name=str(d["name"]), control=str(d.get("control", "")), nvme=str(d.get("nvme", "")),
            capacity_bytes=max(1, int(d.get("capacity_bytes", 1))), zone=str(d.get("zone", "")),
            state=str(d.get("state", "serving")),
        )  # fmt: skip


def membership_epoch(nodes: Iterable[Node]) -> int:
    """A 63-bit hash of the sorted member list (what placement and routing depend on)."""
    h = hashlib.blake2b(digest_size=8)
    for n in sorted(nodes, key=lambda n: n.name):
        h.update(repr((n.name, n.control, n.nvme, n.capacity_bytes, n.zone, n.state)).encode())
        h.update(b"\n")
    return int.from_bytes(h.digest(), "little") >> 1


class Placement:
    """The owners of keys under one member list (only `serving` members own keys)."""

    def __init__(self, nodes: Iterable[Node]) -> None:
        self.nodes: tuple[Node, ...] = tuple(sorted(nodes, key=lambda n: n.name))
        names = [n.name for n in self.nodes]
        assert len(set(names)) == len(names), f"duplicate node names in {names}"
        self.epoch = membership_epoch(self.nodes)
        self.serving: tuple[Node, ...] = tuple(n for n in self.nodes if n.state == "serving")
        self._seeds = np.array([_seed(n.name) for n in self.serving], dtype=np.uint64)
        weights = np.array([n.capacity_bytes for n in self.serving], dtype=np.float64)
        self._equal = bool(len(weights) == 0 or np.all(weights == weights[0]))
        self._weights = weights / (weights.max() if len(weights) else 1.0)
        zones = [n.zone for n in self.serving]
        self._zoned = len(set(zones)) > 1
        self._zone_ids = np.array([sorted(set(zones)).index(z) for z in zones], dtype=np.int64)
        self._zone_count = len(set(zones))

    def __len__(self) -> int:
        return len(self.serving)

    @property
    def delta_safe(self) -> bool:
        """Equal weights and no zones: a key's order over two nodes never depends on the
        others, so a join or leave changes only the keys the joined or gone node ranks in."""
        return self._equal and not self._zoned

    def hash_column(self, k64: np.ndarray, name: str) -> np.ndarray:
        """Node `name`'s equal-weight score (the raw hash) for each key; `name` need not serve."""
        return _mix64(k64 ^ np.uint64(_seed(name)))

    @staticmethod
    def hash_pairs(k64: np.ndarray, names: Sequence[str], idx: np.ndarray) -> np.ndarray:
        """The equal-weight score of key i at node names[idx[i]], for every i at once."""
        seeds = np.array([_seed(n) for n in names], dtype=np.uint64)
        return _mix64(k64 ^ seeds[idx])

    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    # --- scores ---------------------------------------------------------------------------------
    def _scores(self, k64: np.ndarray) -> np.ndarray:
        """[keys x serving nodes] scores; larger wins. Equal weights: the raw hashes."""
        h = _mix64(k64[:, None] ^ self._seeds[None, :])
        if self._equal:
            return h
        u = ((h >> _S11).astype(np.float64) + 0.5) * _INV53
        return -self._weights[None, :] / np.log(u)

    def primary_index(self, k64: np.ndarray) -> np.ndarray:
        """The index (into `serving`) of each key's first owner; -1 with no serving member."""
        if not len(self.serving):
            return np.full(len(k64), -1, dtype=np.int64)
        step = max(1, SCORE_CELLS_MAX // len(self.serving))
        out = np.empty(len(k64), dtype=np.int64)
        for i in range(0, len(k64), step):
            out[i : i + step] = np.argmax(self._scores(k64[i : i + step]), axis=1)
        return out

    def owner_index(self, k64: np.ndarray, replicas: int) -> np.ndarray:
        """[keys x r] indexes into `serving`, best first; r = min(replicas, serving count)."""
        assert 1 <= replicas <= REPLICAS_MAX, replicas
        r = min(replicas, len(self.serving))
        if r == 0:
            return np.empty((len(k64), 0), dtype=np.int64)
        if r == 1:
            return self.primary_index(k64)[:, None]
        step = max(1, SCORE_CELLS_MAX // len(self.serving))
        parts = [self._top(self._scores(k64[i : i + step]), r) for i in range(0, len(k64), step)]
        return np.concatenate(parts) if parts else np.empty((0, r), dtype=np.int64)

    def _top(self, scores: np.ndarray, r: int) -> np.ndarray:
        order = np.argsort(-scores if scores.dtype != np.uint64 else ~scores, axis=1)
        if not self._zoned:
            return order[:, :r]
        out = np.empty((len(scores), r), dtype=np.int64)
        for row, ranked in enumerate(order):  # greedy: best node of each new zone, then fill
            chosen: list[int] = []
            seen: set[int] = set()
            for idx in ranked:
                z = int(self._zone_ids[idx])
                if z not in seen:
                    seen.add(z)
                    chosen.append(int(idx))
                    if len(chosen) == r or len(seen) == self._zone_count:
                        break
            rest = [int(i) for i in ranked if int(i) not in chosen]
            out[row] = (chosen + rest)[:r]
        return out

    # --- by key --------------------------------------------------------------------------------
    def owners(self, key: bytes, replicas: int = 1) -> list[Node]:
        """The owners of one key, best first."""
        idx = self.owner_index(keys64([key]), replicas)[0]
        return [self.serving[int(i)] for i in idx]

    def owners_batch(self, keys: Sequence[bytes], replicas: int = 1) -> list[list[Node]]:
        if not keys:
            return []
        idx = self.owner_index(keys64(keys), replicas)
        return [[self.serving[int(i)] for i in row] for row in idx]
