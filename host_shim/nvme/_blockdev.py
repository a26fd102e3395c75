"""NvmeTcpBlockDevice: a remote namespace as a BlockDevice (SPDK mode).

Satisfies `dpu_agent.blockdev.BlockDevice` structurally (this package never imports the
agent), so an engine tier can live on a namespace that SPDK's target (or ours) exports.
"""

from __future__ import annotations

from typing import Any

from host_shim.nvme._controller import NvmeTcpController
from host_shim.nvme._errors import NvmeError

__all__ = ["NvmeTcpBlockDevice"]


class NvmeTcpBlockDevice:
    """Namespace `nsid` of `controller`; errors surface as `NvmeError`.

    `close()` closes the controller too when `owns_controller` (the default).
    """

    # I/O traits of dpu_agent.blockdev.BlockDevice: every I/O is a round trip to the target.
    in_memory = lends_memory = mapped_reads = buffered_writes = False

    def __init__(
        self, controller: NvmeTcpController, nsid: int, *, owns_controller: bool = True
    ) -> None:
        ns = controller.identify_namespace(nsid)
        if not ns.nsze:
            raise NvmeError(f"namespace {nsid} is not active on {controller.subnqn}")
        self._ctrl = controller
        self._nsid = nsid
        self._block_size = ns.block_size
        self._block_count = ns.nsze
        self._owns = owns_controller

    def __repr__(self) -> str:
        return f"NvmeTcpBlockDevice({self._ctrl.subnqn!r}, nsid={self._nsid})"

    @property
    def nsid(self) -> int:
        return self._nsid

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def block_count(self) -> int:
        return self._block_count

    def _check(self, lba: int, nbytes: int) -> None:
        if nbytes % self._block_size:
            raise NvmeError(f"I/O of {nbytes} bytes is not a multiple of {self._block_size}")
        count = nbytes // self._block_size
        if lba < 0 or lba + count > self._block_count:
            raise NvmeError(f"LBA range {lba}+{count} outside namespace of {self._block_count}")

    def read_into(self, lba: int, buf: Any) -> None:
        self._check(lba, memoryview(buf).nbytes)
        if memoryview(buf).nbytes:
            self._ctrl.read(self._nsid, lba, buf)

    def write(self, lba: int, data: Any) -> None:
        self._check(lba, memoryview(data).nbytes)
        if memoryview(data).nbytes:
            self._ctrl.write(self._nsid, lba, data)

    def flush(self) -> None:
        self._ctrl.flush(self._nsid)

    def deallocate(self, lba: int, block_count: int) -> None:
        self._check(lba, block_count * self._block_size)
        if block_count:
            self._ctrl.deallocate(self._nsid, lba, block_count)

    def close(self) -> None:
        if self._owns:
            self._ctrl.close()
