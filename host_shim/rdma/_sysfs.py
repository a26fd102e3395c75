"""RDMA state read from sysfs, parsed by pure functions (tested on recorded trees).

The kernel's layout (Documentation/ABI/stable/sysfs-class-infiniband)::

    /sys/class/infiniband/<dev>/ports/<port>/gids/<index>              "fe80:0000:...:0001"
    /sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<index>   "RoCE v2" | "IB/RoCE v1"
    /sys/class/infiniband/<dev>/ports/<port>/gid_attrs/ndevs/<index>   "eth0"
    /sys/class/infiniband/<dev>/ports/<port>/link_layer                "Ethernet" | "InfiniBand"

Unused GID slots read as all zeros and their type/ndev files fail to read (EINVAL): skipped.
PFC and trust are not in upstream sysfs (dcbnl carries them); NVIDIA's mlx5 driver (MLNX_OFED,
BlueField images) exposes them under /sys/class/net/<netdev>/qos/ (`trust`: pcp|dscp, `pfc`:
one 0/1 per priority) and ECN per priority under /sys/class/net/<netdev>/ecn/roce_{np,rp}/.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "GID_ENTRIES_MAX",
    "GidEntry",
    "QosState",
    "gid_for_address",
    "parse_pfc",
    "read_gid_table",
    "read_qos",
]

GID_ENTRIES_MAX = 1024  # a port's GID table has 128-256 slots; more is a broken tree
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
PRIORITIES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class GidEntry:
    index: int
    gid: str  # the sysfs form: eight groups of four hex digits
    type: str  # "RoCE v2", "IB/RoCE v1" or "" (InfiniBand ports have no types)
    ndev: str  # the netdev the GID belongs to ("" on InfiniBand)

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
        mapped = self.address.ipv4_mapped
        return str(mapped) if mapped is not None else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # unused GID slots fail with EINVAL; absent knobs with ENOENT
        return None


def read_gid_table(port_dir: Path) -> list[GidEntry]:
    """The port's populated GIDs, by index (zero GIDs and unreadable slots skipped)."""
    gids = port_dir / "gids"
    if not gids.is_dir():
        return []
    out = []
    names = sorted((p.name for p in gids.iterdir() if p.name.isdigit()), key=int)
    for name in names[:GID_ENTRIES_MAX]:
        gid = _read(gids / name)
        if not gid or gid == ZERO_GID:
            continue
        gid_type = _read(port_dir / "gid_attrs" / "types" / name) or ""
        ndev = _read(port_dir / "gid_attrs" / "ndevs" / name) or ""
        out.append(GidEntry(index=int(name), gid=gid, type=gid_type, ndev=ndev))
    return out


def gid_for_address(entries: list[GidEntry], address: str) -> GidEntry | None:
    """The RoCE v2 GID of `address` (IPv4: the ::ffff:a.b.c.d mapped GID; IPv6: itself)."""
    ip = ipaddress.ip_address(address)
    want = ip if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}")
    for e in entries:
        if e.type == "RoCE v2" and e.address == want:
            return e
    return None


def parse_pfc(text: str) -> tuple[bool, ...]:
    """mlx5's qos/pfc: one 0/1 per priority, separated by spaces or commas, or run together."""
    digits = [c for c in text if c in "01"]
    if len(digits) != PRIORITIES or any(c not in "01 ,\n\t" for c in text):
        raise ValueError(f"PFC state {text!r}: expected {PRIORITIES} flags of 0/1")
    return tuple(c == "1" for c in digits)


@dataclass(frozen=True, slots=True, kw_only=True)
class QosState:
    """What the driver's sysfs says about lossless RoCE on one netdev (None: not exposed)."""

    netdev: str
    trust: str | None  # "pcp" or "dscp"
    pfc: tuple[bool, ...] | None  # per priority 0..7
    ecn_np: tuple[bool, ...] | None  # notification point enabled, per priority
    ecn_rp: tuple[bool, ...] | None  # reaction point enabled, per priority
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        names = ("netdev", "trust", "pfc", "ecn_np", "ecn_rp", "problems")
        return {name: getattr(self, name) for name in names}


def _ecn(base: Path) -> tuple[bool, ...] | None:
    if not base.is_dir():
        return None
    flags = [_read(base / str(p)) for p in range(PRIORITIES)]
    return None if None in flags else tuple(f == "1" for f in flags)


def read_qos(netdev: str, *, roce_priority: int = 3, sysfs: Path = Path("/sys")) -> QosState:
    """Trust, PFC and ECN of `netdev`, and what is wrong for lossless RoCE on `roce_priority`
    (3 is NVIDIA's default RoCE priority)."""
    net = sysfs / "class" / "net" / netdev
    trust = _read(net / "qos" / "trust")
    pfc_text = _read(net / "qos" / "pfc")
    problems: list[str] = []
    pfc = None
    if pfc_text is not None:
        try:
            pfc = parse_pfc(pfc_text)
        except ValueError as e:
            problems.append(str(e))
    state = QosState(netdev=netdev, trust=trust, pfc=pfc, ecn_np=_ecn(net / "ecn" / "roce_np"),
                     ecn_rp=_ecn(net / "ecn" / "roce_rp"), problems=problems)  # fmt: skip
    if trust is None and pfc_text is None:
        problems.append(f"{netdev}: no qos/ in sysfs (upstream driver): read PFC with "
                        f"`dcb -j pfc show dev {netdev}`")  # fmt: skip
    if trust is not None and trust != "dscp":
        problems.append(f"{netdev}: trust {trust}; RoCE over L3 wants dscp (mlnx_qos --trust dscp)")
    if pfc is not None and not pfc[roce_priority]:
        problems.append(f"{netdev}: PFC off on priority {roce_priority}: RoCE is not lossless")
    if state.ecn_np is not None and not state.ecn_np[roce_priority]:
        problems.append(f"{netdev}: ECN notification point off on priority {roce_priority}")
    return state
