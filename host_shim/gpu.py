"""Destination KV buffers in GPU memory: GPUDirect RDMA where the host has it, host memory else.

Which path a host gets (`gpu_path()`, `describe()`):

- ``gpudirect-dmabuf``: CUDA, an RDMA device, libibverbs, and a driver that exports dma-bufs.
  The buffers' allocation is exported with ``cuMemGetHandleForAddressRange(...,
  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`` and registered with ``ibv_reg_dmabuf_mr`` (iova = the
  offset, so peers address the region from zero). pyverbs' ``DmaBufMR`` only takes a dma-buf it
  allocated itself from a DRM render node, so the CUDA one is registered through libibverbs
  directly (ctypes), with the same call DmaBufMR makes.
- ``gpudirect-peermem``: as above without dma-buf export, but with the nvidia-peermem module
  loaded, which lets plain ``ibv_reg_mr`` take a CUDA pointer.
- ``host``: no CUDA, no RDMA device, or no libibverbs. Chunks land in host memory (pinned when
  CUDA exists, then copied to the device). The reason is logged once per process.

The registered regions are what an RDMA data path (the DPU's NVMe-oF RDMA target, read by the
kernel initiator with GPUDirect Storage) writes into. The shim's NVMe/TCP data path cannot place
bytes in GPU memory, so there `DeviceChunkBuffers.load` stages through pinned host memory. With
a KVClient on the NIXL path (``transport="nixl"``/``"auto"``) the CUDA tensors themselves are
handed to the shim: NIXL registers them as VRAM (UCX: GPUDirect RDMA on hardware) and the DPU
agent writes into them, no staging (`staging_device` says which device buffers go on).
pyverbs' ``DmaBufMR`` also takes a dma-buf fd (rdma-core 44: ``dmabuf=fd``); host_shim.rdma's
`register_dmabuf` is that path, kept beside the ctypes one here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
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
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
IBV_ACCESS_REMOTE_READ = 4
_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
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
            f"{path.kind}: {path.reason}; GPU buffers registered for RDMA, but the shim's "
            "NVMe/TCP data path stages chunks through pinned host memory"
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


# --- registration (libcuda, libibverbs through ctypes) --------------------------------------


def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class _IbvMr(ctypes.Structure):
    _fields_ = [  # ctypes wants a list
        ("context", ctypes.c_void_p),
        ("pd", ctypes.c_void_p),
        ("addr", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("handle", ctypes.c_uint32),
        ("lkey", ctypes.c_uint32),
        ("rkey", ctypes.c_uint32),
    ]


class _Verbs:
    """A protection domain on the first RDMA device, for registering KV buffers."""

    def __init__(self, device: str) -> None:
        name = ctypes.util.find_library("ibverbs")
        assert name is not None, "choose_path() checked libibverbs"
        lib = self.lib = ctypes.CDLL(name, use_errno=True)
        lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
        lib.ibv_get_device_name.restype = ctypes.c_char_p
        lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
        lib.ibv_open_device.restype = ctypes.c_void_p
        lib.ibv_open_device.argtypes = [ctypes.c_void_p]
        lib.ibv_alloc_pd.restype = ctypes.c_void_p
        lib.ibv_alloc_pd.argtypes = [ctypes.c_void_p]
        lib.ibv_reg_mr.restype = ctypes.POINTER(_IbvMr)
        lib.ibv_reg_mr.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.ibv_reg_dmabuf_mr.restype = ctypes.POINTER(_IbvMr)
        lib.ibv_reg_dmabuf_mr.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.ibv_dereg_mr.argtypes = [ctypes.c_void_p]
        count = ctypes.c_int(0)
        devs = lib.ibv_get_device_list(ctypes.byref(count))
        chosen = next(
            (
                devs[i]
                for i in range(count.value)
                if lib.ibv_get_device_name(devs[i]) == device.encode()
            ),
            None,
        )
        if chosen is None:
            raise OSError(f"RDMA device {device} not found by libibverbs")
        self.ctx = lib.ibv_open_device(chosen)
        self.pd = lib.ibv_alloc_pd(self.ctx) if self.ctx else None
        if not self.pd:
            raise OSError(ctypes.get_errno(), f"ibv_open_device/ibv_alloc_pd({device}) failed")

    def reg_dmabuf(self, tensor: torch.Tensor) -> Any:
        cuda = _libcuda()
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        ptr = ctypes.c_uint64(tensor.data_ptr())
        if cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr):
            raise OSError("cuMemGetAddressRange failed")
        fd = ctypes.c_int(-1)
        if cuda.cuMemGetHandleForAddressRange(
            ctypes.byref(fd), base, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0)
        ):
            raise OSError("cuMemGetHandleForAddressRange(DMA_BUF_FD) failed")
        offset = tensor.data_ptr() - base.value
        nbytes = tensor.numel() * tensor.element_size()
        try:
            mr = self.lib.ibv_reg_dmabuf_mr(self.pd, offset, nbytes, offset, fd.value, _ACCESS)
        finally:
            os.close(fd.value)  # the MR holds its own reference to the dma-buf
        if not mr:
            raise OSError(ctypes.get_errno(), "ibv_reg_dmabuf_mr failed")
        return mr

    def reg_peermem(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        mr = self.lib.ibv_reg_mr(self.pd, tensor.data_ptr(), nbytes, _ACCESS)
        if not mr:
            raise OSError(ctypes.get_errno(), "ibv_reg_mr on CUDA memory failed (nvidia-peermem?)")
        return mr

    def dereg(self, mr: Any) -> None:
        self.lib.ibv_dereg_mr(mr)


# --- the buffers ----------------------------------------------------------------------------


class DeviceChunkBuffers:
    """`count` chunk buffers of `layout.chunk_shape` on `device`, registered where possible.

    `load(client, tokens)` fills them from the tier (a KVClient's `get`) and returns how many
    leading chunks arrived; `chunks` is the ``(count, *chunk_shape)`` tensor on the device.
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
        self.rkey: int | None = None
        self._verbs: _Verbs | None = None
        self._mr: Any = None
        on_gpu = self.device.type == "cuda"
        if self.path.gpudirect and on_gpu:
            self._register()
        else:
            _log_host_path_once(self.path)
        pin = on_gpu and torch.cuda.is_available()
        # Staging: NVMe/TCP lands bytes in host memory; pinned, the copy to the device is a DMA.
        self._staging = (
            torch.empty_like(self.chunks, device="cpu").pin_memory() if on_gpu and pin else None
        )

    def _register(self) -> None:
        self._verbs = _Verbs(self.path.probe.rdma_devices[0])
        if self.path.kind == "gpudirect-dmabuf":
            self._mr = self._verbs.reg_dmabuf(self.chunks)
        else:
            self._mr = self._verbs.reg_peermem(self.chunks)
        self.rkey = int(self._mr.contents.rkey)
        log.info("KV buffers registered for GPUDirect: %s", describe(self.path))

    def load(self, client: Any, tokens: Sequence[int]) -> int:
        """Read the cached prefix of `tokens` into the buffers; leading chunks loaded. On the
        NIXL path straight into the device buffers, else through the pinned staging copy."""
        if staging_device(client, self.device) == self.device:
            return int(client.get(tokens, list(self.chunks.unbind(0))))
        target = self._staging if self._staging is not None else self.chunks
        loaded = int(client.get(tokens, list(target.unbind(0))))
        if self._staging is not None and loaded:
            self.chunks[:loaded].copy_(self._staging[:loaded], non_blocking=True)
            torch.cuda.current_stream().synchronize()
        return loaded

    def close(self) -> None:
        if self._mr is not None and self._verbs is not None:
            self._verbs.dereg(self._mr)
            self._mr = None
