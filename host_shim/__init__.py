"""host_shim: the GPU server's thin client of the context-memory tier."""

from host_shim.client import KVClient

__all__ = ["KVClient"]
