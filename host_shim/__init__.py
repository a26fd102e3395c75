"""host_shim: the GPU server's thin client of the context-memory tier."""
