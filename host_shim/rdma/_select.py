"""Which RDMA device, port and GID index UCX uses for the configured address, and whether the
port may carry RDMA at all: read from sysfs, decided by pure functions (tested on recorded
trees), handed to UCX as `UCX_NET_DEVICES=<dev>:<port>` and `UCX_IB_GID_INDEX=<index>`.

Without the two variables UCX picks every device and GID index 3 by default, which on a
BlueField with two PFs and an IPv6 link-local GID first sends RoCE from the wrong port or
with a v1 GID that routers drop. The port's `state` file reads "<n>: <NAME>" (kernel
drivers/infiniband/core/sysfs.c, state_show: "4: ACTIVE", "1: DOWN"); `link_layer` reads
"Ethernet" or "InfiniBand" (link_layer_show); GID types read "RoCE v2" or "IB/RoCE v1".

Refused (RdmaRefused, the message says what to fix): no RoCE v2 GID for the address, the
port not ACTIVE, a link layer other than Ethernet, PFC off on the RoCE priority, or PFC state
unreadable (neither mlx5's qos/pfc nor the `pfc_of` reader the caller passes, e.g. `dcb`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_shim.rdma._sysfs import GidEntry, gid_for_address, read_gid_table, read_qos

__all__ = ["RdmaRefused", "RdmaSelection", "select_rdma"]

DEVICES_MAX = 64  # RDMA devices looked at (a BlueField shows a few; SR-IOV hosts dozens)
PORTS_MAX = 8
ROCE_PRIORITY_DEFAULT = 3  # NVIDIA's default RoCE traffic class priority


class RdmaRefused(Exception):
    """The RDMA transport must not start for this address; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RdmaSelection:
    device: str
    port: int
    gid_index: int
    gid: str
    netdev: str
    state: str
    link_layer: str
    roce_priority: int
    pfc: tuple[int, ...]  # priorities with PFC on

    def ucx_env(self) -> dict[str, str]:
        return {"UCX_NET_DEVICES": f"{self.device}:{self.port}",
                "UCX_IB_GID_INDEX": str(self.gid_index)}  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        names = ("device", "port", "gid_index", "gid", "netdev", "state", "link_layer",
                 "roce_priority", "pfc")  # fmt: skip
        return {n: getattr(self, n) for n in names} | {"ucx_env": self.ucx_env()}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _state_name(text: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE" (the kernel's state_show format)."""
    return text.partition(":")[2].strip() if ":" in text else text


def _find(address: str, sysfs: Path) -> tuple[str, Path, GidEntry]:
    root = sysfs / "class" / "infiniband"
    devices = sorted(p.name for p in root.iterdir())[:DEVICES_MAX] if root.is_dir() else []
    for dev in devices:
        ports = root / dev / "ports"
        if not ports.is_dir():
            continue
        names = sorted((p.name for p in ports.iterdir() if p.name.isdigit()), key=int)
        for name in names[:PORTS_MAX]:
            entry = gid_for_address(read_gid_table(ports / name), address)
            if entry is not None:
                return dev, ports / name, entry
    raise RdmaRefused(
        f"no RoCE v2 GID for {address} on any of {devices or 'no RDMA devices'} "
        f"(is the address on the RDMA port's netdev?)"
    )


def select_rdma(
    address: str,
    *,
    roce_priority: int = ROCE_PRIORITY_DEFAULT,
    sysfs: Path = Path("/sys"),
    pfc_of: Callable[[str], tuple[int, ...] | None] | None = None,
) -> RdmaSelection:
    """The device, port and RoCE v2 GID index of `address`, checked for RDMA: ACTIVE,
    Ethernet, PFC on `roce_priority`. `pfc_of(netdev)` (priorities with PFC on, or None when
    unreadable) is asked when the driver has no qos/pfc in sysfs (upstream mlx5: dcbnl only)."""
    dev, port_dir, entry = _find(address, sysfs)
    where = f"{dev} port {port_dir.name} ({entry.ndev or '?'})"
    state = _state_name(_read(port_dir / "state"))
    if state != "ACTIVE":
        raise RdmaRefused(f"{where} is {state or 'unreadable'}, not ACTIVE: link down?")
    link_layer = _read(port_dir / "link_layer")
    if link_layer != "Ethernet":
        raise RdmaRefused(f"{where} link layer is {link_layer or 'unreadable'}, not Ethernet "
                          "(RoCE): set LINK_TYPE_P<n>=2 (mlxconfig)")  # fmt: skip
    qos = read_qos(entry.ndev, roce_priority=roce_priority, sysfs=sysfs)
    if qos.pfc is not None:
        pfc: tuple[int, ...] | None = tuple(i for i, on in enumerate(qos.pfc) if on)
    else:
        pfc = pfc_of(entry.ndev) if pfc_of is not None and entry.ndev else None
    if pfc is None:
        raise RdmaRefused(f"{where}: PFC state unreadable (no qos/pfc in sysfs, no dcb answer): "
                          "RoCE would not be known lossless")  # fmt: skip
    if roce_priority not in pfc:
        raise RdmaRefused(f"{where}: PFC off on priority {roce_priority} (on: {list(pfc)}): "
                          "RoCE is not lossless (dpuctl net apply, pfc_priorities)")  # fmt: skip
    return RdmaSelection(device=dev, port=int(port_dir.name), gid_index=entry.index, gid=entry.gid,
                         netdev=entry.ndev, state=state, link_layer=link_layer,
                         roce_priority=roce_priority, pfc=pfc)  # fmt: skip
