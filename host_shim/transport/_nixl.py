"""The host side of the NIXL data path: register destination buffers, let the DPU move bytes.

The DPU agent drives every transfer (DESIGN.md, Data path): for a get the host sends the keys
and the descriptors of its registered buffers over the control plane, the agent decrypts the
chunks into its own registered staging buffers, verifies each chunk's checksum, and posts
one-sided NIXL WRITEs into the host's buffers; it replies once they completed. A put is the
mirror: the agent READs the host's buffers. The host never copies or hashes chunk bytes here.
Over RDMA (UCX on verbs) the host CPU does nothing per byte; over UCX-TCP (no RDMA device) the
host's NIXL progress thread receives the TCP stream, which `dpuctl bench datapath` measures.

Registration: a buffer is registered with the host's NIXL agent the first time it is used and
kept registered (the engine's KV pool is long-lived); the registry holds a reference to it, so
its address cannot be reused by another allocation while the NIC may still target it. The
agent learns each region (and the host agent's refreshed metadata) through `nixl_register` and
refuses descriptors outside the regions its session registered.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from host_shim.transport._lib import new_agent

__all__ = [
    "NIXL_REGIONS_MAX",
    "NIXL_REGISTERED_BYTES_MAX",
    "BufferDesc",
    "NixlHostPath",
    "buffer_desc",
]

log = logging.getLogger("host_shim.transport")

# Regions the host keeps registered (and the agent remembers per session): an engine's KV pool
# is a few large tensors or a few thousand chunk buffers; kvproto.control.NIXL_REGIONS_MAX.
NIXL_REGIONS_MAX = 4096
# Bytes kept registered; beyond this the least recently used buffers are deregistered (pinned
# memory on RDMA hardware is a scarce resource). 64 GiB covers a GPU's whole HBM.
NIXL_REGISTERED_BYTES_MAX = 64 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferDesc:
    """A chunk buffer (addr, nbytes) inside the allocation that gets registered (region_*)."""

    addr: int
    nbytes: int
    dev: int
    mem: str  # "DRAM" or "VRAM"
    region_addr: int
    region_bytes: int
    owner: Any  # the object keeping the region's memory alive while registered

    @property
    def region(self) -> tuple[int, int, int, str]:
        return (self.region_addr, self.region_bytes, self.dev, self.mem)


def _tensor_desc(buf: Any, nbytes: int) -> BufferDesc:
    """A torch tensor: its whole storage is the region (a KV pool's chunk views share one)."""
    if not buf.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(buf.shape)} is not contiguous")
    size = buf.numel() * buf.element_size()
    if size != nbytes:
        raise ValueError(f"buffer holds {size} bytes; a chunk of this layout is {nbytes}")
    if buf.device.type not in ("cpu", "cuda"):
        raise ValueError(f"buffer on {buf.device}: NIXL takes CPU or CUDA tensors")
    storage = buf.untyped_storage()
    vram = buf.device.type == "cuda"
    return BufferDesc(addr=buf.data_ptr(), nbytes=size, dev=int(buf.device.index or 0) if vram
                      else 0, mem="VRAM" if vram else "DRAM", region_addr=storage.data_ptr(),
                      region_bytes=storage.nbytes(), owner=storage)  # fmt: skip


def buffer_desc(buf: Any, nbytes: int, *, writable: bool) -> BufferDesc:
    """The descriptor of one chunk buffer: a CUDA tensor as VRAM (no staging), anything with
    the buffer protocol (numpy, bytearray, CPU tensors) as DRAM. ValueError when the buffer is
    not contiguous, read-only where written, or not `nbytes` long."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return _tensor_desc(buf, nbytes)
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("buffer is not C-contiguous")
        if writable and view.readonly:
            raise ValueError(f"buffer of type {type(buf).__name__} is read-only; get() writes it")
        arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                            np.uint8)  # fmt: skip
    if not arr.flags.c_contiguous:
        raise ValueError(f"buffer of shape {arr.shape} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("buffer is read-only; get() writes into it")
    if arr.nbytes != nbytes:
        raise ValueError(f"buffer holds {arr.nbytes} bytes; a chunk of this layout is {nbytes}")
    root = arr
    while isinstance(root.base, np.ndarray):  # views of one pool share one region
        root = root.base
    low, high = _byte_bounds(root)
    return BufferDesc(addr=int(arr.ctypes.data), nbytes=arr.nbytes, dev=0, mem="DRAM",
                      region_addr=int(low), region_bytes=int(high - low), owner=root)  # fmt: skip


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    """numpy >= 2 moved byte_bounds into numpy.lib.array_utils."""
    utils = getattr(np.lib, "array_utils", None)
    bounds = utils.byte_bounds(arr) if utils is not None else np.byte_bounds(arr)  # type: ignore[attr-defined]
    return int(bounds[0]), int(bounds[1])


class NixlHostPath:
    """One host NIXL agent and its registered regions; the control channel carries the rest.

    The host agent runs NIXL's progress thread: it is the passive side of every transfer and
    must keep UCX moving while the calling thread waits for the agent's reply. Not thread-safe:
    KVClient calls it under its lock.
    """

    def __init__(self, tenant: str) -> None:
        # the agent accepts only names of the session's tenant: dpukv.<tenant>.<unique>
        self.name = f"dpukv.{tenant}.{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._agent = new_agent(self.name, progress_thread=True)
        # region -> (reg handle, owner); insertion order = least recently used first
        self._regs: collections.OrderedDict[tuple[int, int, int, str], tuple[Any, Any]] = (
            collections.OrderedDict()
        )
        self._registered_bytes = 0
        self._dropping: list[tuple[Any, Any]] = []  # deregistered once the agent forgot them
        self.agent_name = ""  # the DPU agent's NIXL name, from nixl_connect

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def prepare(self, descs: Sequence[BufferDesc]) -> tuple[list[list[Any]], list[list[Any]]]:
        """Register the regions of `descs` not registered yet. Returns (added, dropped) regions
        as [addr, nbytes, dev, mem] for nixl_register; dropped ones (least recently used,
        beyond the limits) are deregistered by `commit()` once the agent has forgotten them."""
        added: list[list[Any]] = []
        for d in descs:
            k = d.region
            if k in self._regs:
                self._regs.move_to_end(k)
                continue
            handle = self._agent.register_memory([(k[0], k[1], k[2], "")], d.mem)
            self._regs[k] = (handle, d.owner)
            self._registered_bytes += k[1]
            added.append(list(k))
        in_use = {d.region for d in descs}
        dropped: list[list[Any]] = []
        for k in list(self._regs):
            over = (len(self._regs) > NIXL_REGIONS_MAX
                    or self._registered_bytes > NIXL_REGISTERED_BYTES_MAX)  # fmt: skip
            if not over:
                break
            if k in in_use:
                continue
            self._dropping.append(self._regs.pop(k))
            self._registered_bytes -= k[1]
            dropped.append(list(k))
        return added, dropped

    def commit(self) -> None:
        """The agent acknowledged the dropped regions: deregister them."""
        for handle, _owner in self._dropping:
            self._agent.deregister_memory(handle)
        self._dropping.clear()

    def regions(self) -> list[list[Any]]:
        """Every registered region (after a reconnect the agent learns them all again)."""
        return [list(k) for k in self._regs]

    def close(self) -> None:
        """Destroy the NIXL agent (its progress thread stops), then let the buffers go."""
        self._agent = None
        self._regs.clear()
        self._dropping.clear()
        self._registered_bytes = 0
