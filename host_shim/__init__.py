"""host_shim: the GPU server's thin client of the context-memory tier."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from host_shim.client import KVClient

__all__ = ["KVClient"]


def __getattr__(name: str) -> Any:
    """KVClient on first use: `host_shim.control` (what dpuctl needs) imports without the data
    path (NVMe/TCP, numpy)."""
    if name == "KVClient":
        from host_shim.client import KVClient

        return KVClient
    raise AttributeError(f"module 'host_shim' has no attribute {name!r}")
