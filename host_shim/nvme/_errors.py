"""Errors of the userspace NVMe/TCP initiator."""

from __future__ import annotations

from kvproto.nvme import Cqe, Status

__all__ = ["NvmeError", "NvmeStatusError", "NvmeTransportError"]


class NvmeError(Exception):
    """Base of the initiator's errors."""


class NvmeTransportError(NvmeError):
    """The connection failed (closed, reset, timed out, or a TermReq): that queue is unusable."""


class NvmeStatusError(NvmeError):
    """A command completed with an error status; the queue stays usable."""

    def __init__(self, what: str, cqe: Cqe) -> None:
        try:
            name = Status(cqe.code).name
        except ValueError:
            name = "UNKNOWN"
        super().__init__(
            f"{what} failed: status {name} (sct {cqe.sct:#x}, sc {cqe.sc:#x}"
            f"{', do not retry' if cqe.dnr else ''}), cdw0 {cqe.cdw0:#x}"
        )
        self.cqe = cqe
        self.sct = cqe.sct
        self.sc = cqe.sc
        self.dnr = cqe.dnr
        self.code = cqe.code
