"""kvproto: wire formats both the agent and the host shim speak (sans-I/O, no sockets).

Chunk keys, checksums, control-plane frames and NVMe/TCP PDUs. Depends only on the host
shim's own dependencies (msgpack, xxhash, numpy).
"""
