"""Destination KV buffers in GPU memory, and which GPUDirect path a host offers.

Which path a host has (`gpu_path()`, `describe()`, `dpuctl doctor`):

- ``gpudirect-dmabuf``: CUDA, an RDMA device, libibverbs, and a driver that exports dma-bufs
  (``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)``).
- ``gpudirect-peermem``: as above without dma-buf export, but with the nvidia-peermem module
  loaded, which lets plain ``ibv_reg_mr`` take a CUDA pointer.
- ``host``: no CUDA, no RDMA device, or no libibverbs. Chunks land in host memory (pinned when
  CUDA exists, then copied to the device). The reason is logged once per process.

GPU buffers are registered once, by the transport that moves bytes into them: with a KVClient
on the NIXL path (``transport="nixl"``/``"auto"``) the CUDA tensors themselves are handed to the
shim, whose NIXL agent registers them as VRAM (`host_shim.transport.buffer_desc`; UCX then uses
dma-buf or peermem itself, per the path above) and the DPU agent writes into them, no staging
(`staging_device` says which device buffers go on). The shim's NVMe/TCP data path cannot place
bytes in GPU memory, so there `DeviceChunkBuffers.load` stages through pinned host memory and
nothing is registered with the NIC.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kvproto.keys import ChunkLayout

__all__ = [
    "DeviceChunkBuffers",
    "GpuPath",
    "HostProbe",
    "choose_path",
    "describe",
    "gpu_path",
    "probe_host",
    "staging_device",
]

log = logging.getLogger("host_shim.gpu")

PathKind = Literal["gpudirect-dmabuf", "gpudirect-peermem", "host"]
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_host_path_logged = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HostProbe:
    """What this host has, as far as GPUDirect goes (the input of `choose_path`)."""

    cuda: bool
    rdma_devices: tuple[str, ...]
    libibverbs: bool
    dmabuf_export: bool  # the CUDA driver exports dma-bufs for device memory
    peermem: bool  # the nvidia_peermem kernel module is loaded


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPath:
    kind: PathKind
    reason: str
    probe: HostProbe = field(repr=False)

    @property
    def gpudirect(self) -> bool:
        return self.kind != "host"


def _cuda_dmabuf_supported() -> bool:
    lib = _libcuda()
    if lib is None or not hasattr(lib, "cuMemGetHandleForAddressRange"):
        return False
    value = ctypes.c_int(0)
    dev = torch.cuda.current_device()
    if lib.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev):
        return False
    return bool(value.value)


def probe_host(sysfs: Path = Path("/sys")) -> HostProbe:
    """Probe this machine: CUDA (through torch), /sys/class/infiniband, libibverbs, peermem."""
    cuda = torch.cuda.is_available()
    ib = sysfs / "class" / "infiniband"
    devices = tuple(sorted(p.name for p in ib.iterdir())) if ib.is_dir() else ()
    return HostProbe(
        cuda=cuda,
        rdma_devices=devices,
        libibverbs=ctypes.util.find_library("ibverbs") is not None,
        dmabuf_export=cuda and _cuda_dmabuf_supported(),
        peermem=(sysfs / "module" / "nvidia_peermem").is_dir(),
    )


def choose_path(probe: HostProbe) -> GpuPath:
    """The path a host with `probe` gets, and why (pure: the decision table)."""
    devs = ",".join(probe.rdma_devices)
    kind: PathKind = "host"
    if not probe.cuda:
        reason = "no CUDA device (torch.cuda.is_available() is False)"
    elif not probe.rdma_devices:
        reason = "no RDMA device (/sys/class/infiniband is empty)"
    elif not probe.libibverbs:
        reason = "libibverbs missing (apt install rdma-core ibverbs-providers)"
    elif probe.dmabuf_export:
        kind, reason = "gpudirect-dmabuf", f"CUDA dma-buf export + RDMA ({devs})"
    elif probe.peermem:
        kind, reason = "gpudirect-peermem", f"nvidia-peermem + RDMA ({devs})"
    else:
        reason = (
            "the CUDA driver exports no dma-buf (needs driver >= 515 / CUDA 11.7 and kernel "
            ">= 5.12) and nvidia-peermem is not loaded (modprobe nvidia-peermem)"
        )
    return GpuPath(kind=kind, reason=reason, probe=probe)


def gpu_path() -> GpuPath:
    """The path this host gets."""
    return choose_path(probe_host())


def describe(path: GpuPath | None = None) -> str:
    """One line for logs and `dpuctl doctor`: the path, why, and what the data path does."""
    path = path or gpu_path()
    if path.gpudirect:
        return (
            f"{path.kind}: {path.reason}; the NIXL data path registers GPU buffers as VRAM "
            "(GPUDirect RDMA), NVMe/TCP stages chunks through pinned host memory"
        )
    return f"host memory: {path.reason}"


def staging_device(client: Any, device: torch.device | str) -> torch.device:
    """Where KV buffers for `client` go when the engine's KV lives on `device`: the device
    itself when the client's data path is NIXL (the agent writes into VRAM directly), host
    memory otherwise (NVMe/TCP lands bytes in host memory)."""
    device = torch.device(device)
    direct = getattr(client, "transport", "") == "nixl" and device.type == "cuda"
    return device if direct else torch.device("cpu")


def _log_host_path_once(path: GpuPath) -> None:
    global _host_path_logged
    if not _host_path_logged:
        log.warning("KV chunks go through host memory: %s", path.reason)
        _host_path_logged = True


# --- libcuda (the dma-buf export probe) ----------------------------------------------------


def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


# --- the buffers ----------------------------------------------------------------------------


class DeviceChunkBuffers:
    """`count` chunk buffers of `layout.chunk_shape` on `device`.

    `load(client, tokens)` fills them from the tier (a KVClient's `get`) and returns how many
    leading chunks arrived; `chunks` is the ``(count, *chunk_shape)`` tensor on the device.
    Nothing is registered here: on the NIXL path the client's NIXL agent registers `chunks` as
    VRAM the first time they are used; on NVMe/TCP the bytes go through the pinned staging copy.
    """

    def __init__(
        self,
        layout: ChunkLayout,
        count: int,
        *,
        device: str | torch.device = "cuda",
        dtype: torch.dtype,
        path: GpuPath | None = None,
    ) -> None:
        assert count >= 1, count
        self.layout = layout
        self.device = torch.device(device)
        self.path = path or gpu_path()
        self.chunks = torch.empty((count, *layout.chunk_shape), dtype=dtype, device=self.device)
        on_gpu = self.device.type == "cuda"
        if not (self.path.gpudirect and on_gpu):
            _log_host_path_once(self.path)
        pin = on_gpu and torch.cuda.is_available()
        # Staging: NVMe/TCP lands bytes in host memory; pinned, the copy to the device is a DMA.
        self._staging = (
            torch.empty_like(self.chunks, device="cpu").pin_memory() if on_gpu and pin else None
        )

    def load(self, client: Any, tokens: Sequence[int]) -> int:
        """Read the cached prefix of `tokens` into the buffers; leading chunks loaded. On the
        NIXL path straight into the device buffers (NIXL registers them), else through the
        pinned staging copy."""
        if staging_device(client, self.device) == self.device:
            return int(client.get(tokens, list(self.chunks.unbind(0))))
        target = self._staging if self._staging is not None else self.chunks
        loaded = int(client.get(tokens, list(target.unbind(0))))
        if self._staging is not None and loaded:
            self.chunks[:loaded].copy_(self._staging[:loaded], non_blocking=True)
            torch.cuda.current_stream().synchronize()
        return loaded

    def close(self) -> None:
        """Let the staging copy go (the device buffers stay the caller's)."""
        self._staging = None
