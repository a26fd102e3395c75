"""pyverbs: RDMA devices and ports, and memory registration by dma-buf.

pyverbs comes from Debian's `python3-pyverbs` (rdma-core, built for the system python3; the
same CPython 3.11 ABI loads it from a venv, so only the `pyverbs` package is loaded from the
Debian directory, nothing else from there) or from PyPI's `pyverbs` (an sdist that needs
Cython and a matching rdma-core). `pyverbs_source()` says which; `dpuctl doctor` shows it.

With no RDMA device, `get_device_list()` raises (ENOSYS here); `list_devices()` turns that into
RdmaUnavailable, logged once per process: the NIXL path then runs over UCX's TCP transport.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from host_shim.rdma._sysfs import GidEntry, gid_for_address, read_gid_table

__all__ = [
    "DEBIAN_DIST_PACKAGES",
    "PortInfo",
    "RdmaDevice",
    "RdmaUnavailable",
    "list_devices",
    "load_pyverbs",
    "pyverbs_source",
    "register_dmabuf",
    "roce_gid",
]

log = logging.getLogger("host_shim.rdma")

DEBIAN_DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
DEVICES_MAX = 64  # RDMA devices listed (a BlueField shows a few; SR-IOV hosts dozens)
PORTS_MAX = 8

_lock = threading.Lock()
_source: str | None = None
_no_device_logged = False


class RdmaUnavailable(Exception):
    """No pyverbs, or no RDMA device: the message says which and what to do."""


def load_pyverbs() -> ModuleType:
    """The `pyverbs` package: importable here, else Debian's python3-pyverbs directory."""
    global _source
    with _lock:
        try:
            mod = importlib.import_module("pyverbs")
            _source = _source or f"pyverbs from {Path(mod.__file__ or '?').parent.parent}"
            return mod
        except ImportError:
            pass
        spec = importlib.machinery.PathFinder.find_spec("pyverbs", [str(DEBIAN_DIST_PACKAGES)])
        if spec is None or spec.loader is None:
            raise RdmaUnavailable(
                "pyverbs is not installed: apt-get install python3-pyverbs (rdma-core)"
            )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # another CPython ABI, missing libibverbs
            del sys.modules["pyverbs"]
            raise RdmaUnavailable(f"Debian's pyverbs does not load here: {e}") from None
        _source = f"Debian python3-pyverbs ({DEBIAN_DIST_PACKAGES})"
        return mod


def pyverbs_source() -> str:
    """Where pyverbs came from, or why it is missing (for doctor)."""
    try:
        load_pyverbs()
    except RdmaUnavailable as e:
        return f"unavailable: {e}"
    return _source or "?"


@dataclass(frozen=True, slots=True, kw_only=True)
class PortInfo:
    port: int
    state: str  # "active", "down", ...
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    active_mtu: int  # bytes
    gids: list[GidEntry] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class RdmaDevice:
    name: str
    ports: list[PortInfo]


_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu
_PORT_STATES = {0: "nop", 1: "down", 2: "init", 3: "armed", 4: "active", 5: "active_defer"}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}


def _port(ctx: Any, name: str, port: int, sysfs: Path) -> PortInfo:
    attr = ctx.query_port(port)
    port_dir = sysfs / "class" / "infiniband" / name / "ports" / str(port)
    return PortInfo(
        port=port,
        state=_PORT_STATES.get(int(attr.state), str(attr.state)),
        link_layer=_LINK_LAYERS.get(int(attr.link_layer), str(attr.link_layer)),
        active_mtu=_MTU_BYTES.get(int(attr.active_mtu), 0),
        gids=read_gid_table(port_dir),
    )


def list_devices(sysfs: Path = Path("/sys")) -> list[RdmaDevice]:
    """Every RDMA device with its ports (state, link layer, active MTU, GID table), through
    pyverbs; RdmaUnavailable (logged once per process) when there is none."""
    global _no_device_logged
    pyverbs = load_pyverbs()
    device = importlib.import_module("pyverbs.device")
    try:
        devs = device.get_device_list()
    except pyverbs.pyverbs_error.PyverbsError as e:
        devs, why = [], str(e)
    else:
        why = "get_device_list() is empty"
    if not devs:
        reason = f"no RDMA device ({why}); NIXL runs over UCX's TCP transport"
        if not _no_device_logged:
            log.warning("rdma: %s", reason)
            _no_device_logged = True
        raise RdmaUnavailable(reason)
    out = []
    for d in devs[:DEVICES_MAX]:
        name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
        with device.Context(name=name) as ctx:
            count = min(int(ctx.query_device().phys_port_cnt), PORTS_MAX)
            out.append(RdmaDevice(name=name, ports=[_port(ctx, name, p, sysfs)
                                                    for p in range(1, count + 1)]))  # fmt: skip
    return out


def roce_gid(devices: list[RdmaDevice], address: str) -> tuple[str, int, GidEntry] | None:
    """(device, port, GID entry) of the RoCE v2 GID for `address` on an Ethernet port."""
    for dev in devices:
        for port in dev.ports:
            if port.link_layer != "Ethernet":
                continue
            entry = gid_for_address(port.gids, address)
            if entry is not None:
                return dev.name, port.port, entry
    return None


def register_dmabuf(device_name: str, fd: int, offset: int, length: int) -> Any:
    """Register `length` bytes at `offset` of a dma-buf (a CUDA allocation exported with
    cuMemGetHandleForAddressRange) with the NIC through pyverbs' DmaBufMR: the path for GPU
    memory where nvidia-peermem is absent. Returns (context, pd, mr); keep them alive."""
    load_pyverbs()
    device = importlib.import_module("pyverbs.device")
    pd_mod = importlib.import_module("pyverbs.pd")
    mr_mod = importlib.import_module("pyverbs.mr")
    access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
    ctx = device.Context(name=device_name)
    pd = pd_mod.PD(ctx)
    mr = mr_mod.DmaBufMR(pd, length, access, dmabuf=fd, offset=offset)
    return ctx, pd, mr
