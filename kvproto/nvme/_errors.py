"""The two error classes of the NVMe/TCP codec, and the Fatal Error Status values they carry."""

from __future__ import annotations

import enum

__all__ = ["Fes", "LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class Fes(enum.IntEnum):
    """Fatal Error Status of an H2CTermReq/C2HTermReq (NVMe/TCP 1.0, figure "FES")."""

    INVALID_PDU_HEADER_FIELD = 0x01
    PDU_SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03
    DATA_TRANSFER_OUT_OF_RANGE = 0x04
    DATA_TRANSFER_LIMIT_EXCEEDED = 0x05  # "R2T limit exceeded" in the 1.0 text
    UNSUPPORTED_PARAMETER = 0x06


class ProtocolError(Exception):
    """Base of both codec errors; after one the queue pair is in ERROR and must be closed."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids.

    `fes` and `fei` (the byte offset of the offending field for header-field errors) go into
    the TermReq sent back; `header` holds the offending PDU header, echoed as its data.
    """

    def __init__(self, msg: str, *, fes: Fes, fei: int = 0, header: bytes = b"") -> None:
        super().__init__(msg)
        self.fes = fes
        self.fei = fei
        self.header = header
