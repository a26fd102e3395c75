"""NIXL agent metadata written in nixl-cu12's layout (nixlSerDes), for tests that feed the agent
metadata of their own making: the same layout dpu_agent.nixl._metadata parses."""

from __future__ import annotations

import struct

# UCX worker addresses as UCX 1.23 (nixl-cu12 1.5.1) packed them here with UCX_TLS=tcp: an
# eth0 at 192.0.2.2 and lo. Format v1 (the default): header 0x20 (version 0, uuid flag), uuid,
# per device md index, device address length and address, per transport the name checksum of
# "tcp", 16 bytes of attributes, the interface address (the port); then v1's release-version
# pseudo device (0x87 0x80).
UCX_ADDRESS = bytes.fromhex(
    "20edf300ce1d410c7000060002c0000202cf1917b751389763344bd7e037370013230082bfc5000e010225"
    "176a884ccca1b3f9ffffefcf1917b75138539e3e4bd7e0373701132300829e2d8780"
)
# The same with UCX_ADDRESS_VERSION=v2 UCX_ADDRESS_DEBUG_INFO=y: a two-byte header, the
# worker's name, 8 bytes of attributes.
UCX_ADDRESS_V2 = bytes.fromhex(
    "710385900f9f5480a01207766d3a3236363600060002c0000202cf190c015a0080008b008283bd008e0102"
    "25176a884ccca1b3f9ffffefcf190c015a0180008b0082a32d"
)
# UCX_TLS=tcp,self,sm: shared-memory and self transports beside tcp (checksums other than tcp's).
UCX_ADDRESS_SM = bytes.fromhex(
    "206104342e6b9634e60000637577cc2b320040975000000000004f03c0884332a583c1d444fe01060002c000"
    "0202cf1917b751389763344bd7e0373700132300829879010e010225176a884ccca1b3f9ffffefcf1917b751"
    "38539e3e4bd7e0373701132300828605020825176a884ccca1338d5377cc2b320000705077ccab33004f23c0"
    "881a80150000000000030825176a884ccca133a7d377cc2b320000705077ccab33004f23c088c60a00800300"
    "00c0040825176a884ccca133478bbd37063600242e5077ccab330092210084c60a00008780"
)


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
