"""NIXL agent metadata written in nixl-cu12's layout (nixlSerDes), for tests that feed the agent
metadata of their own making: the same layout dpu_agent.nixl._metadata parses."""

from __future__ import annotations

import struct

# A UCX worker address as UCX 1.23 packs one for TCP on loopback: header (version 0, uuid
# flag), uuid, then devices; only the header and the length are read before NIXL.
UCX_ADDRESS = bytes.fromhex("20bdc3cb305eda69cf00060002c000020200") + bytes(88)


def entry(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def encode(
    name: bytes,
    conns: list[tuple[bytes, bytes]] | None = None,
    sections: list[tuple[bytes, int, list[tuple[int, int, int, bytes]]]] | None = None,
) -> bytes:
    """nixlSerDes metadata: `conns` (backend, connection info), `sections` (backend, memory
    type, [(addr, len, dev, remote key)])."""
    conns = [(b"UCX", UCX_ADDRESS)] if conns is None else conns
    out = b"nixlSerDes|" + entry(b"Agent", name) + entry(b"Conns", struct.pack("<Q", len(conns)))
    for backend, info in conns:
        out += entry(b"t", backend) + entry(b"c", info)
    out += entry(b"", b"MemSection")
    sections = sections or []
    out += entry(b"nixlSecElms", struct.pack("<Q", len(sections)))
    for backend, mem, descs in sections:
        out += entry(b"bknd", backend) + entry(b"nixlDList", b"nixlSDList")
        out += entry(b"t", struct.pack("<I", mem)) + entry(b"n", struct.pack("<Q", len(descs)))
        for addr, n, dev, rkey in descs:
            out += entry(b"", struct.pack("<QQQ", addr, n, dev) + rkey)
    return out
