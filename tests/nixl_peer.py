"""The host side of the NIXL tests, run as its own process (python tests/nixl_peer.py SCENARIO
CONTROL_URL TOKEN [ADMIN_TOKEN]): the agent is another process, UCX moves bytes between them
over TCP. Prints one JSON line with what it saw; exits with os._exit, because a process that
used NIXL may crash in NIXL's teardown at exit (docs/MEASURED.md), which says nothing
about the transfers tested here."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from host_shim.client import ControlChannel, ControlError, KVClient
from host_shim.transport import NixlHostPath, buffer_desc
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("nixl-test", "float16", 2, 2, 64, chunk_tokens=16)  # 16 KiB chunks
SALT = b"nixl-test-salt-012345"
# 3 segments of the agent's 4 MiB plus a partial block: exercises segments and the tail
ODD_BYTES = (8 << 20) + (1 << 20) + 1000
BATCH_CHUNKS, BATCH_CHUNK_BYTES, BATCH_ROUNDS = 4, 32 << 20, 4  # 32 segments a batch
KILL_CHUNK_BYTES = 8 << 20
KILL_CHUNKS = 24  # 192 MiB: long enough over UCX-TCP to be killed mid-way


def _no_host_bytes_work() -> None:
    """Make every shim function that copies, reads or hashes chunk bytes fail: the NIXL path
    must not call any of them (the agent moves and verifies the bytes)."""
    import host_shim.control as hc

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the NIXL path touched chunk bytes in the shim")

    for name in ("byte_view", "_segment_io_raw", "chunk_checksum", "verify_checksum"):
        setattr(hc, name, forbidden)


def roundtrip(url: str, token: str) -> dict[str, Any]:
    _no_host_bytes_work()
    rng = np.random.default_rng(5)
    out: dict[str, Any] = {}
    with KVClient(url, "default", token, LAYOUT, SALT, transport="nixl") as c:
        chunks = [rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
                  for _ in range(6)]  # fmt: skip
        tokens = np.arange(6 * LAYOUT.chunk_tokens, dtype=np.uint32) + 7
        out["stored"] = c.put(tokens, chunks)
        out["transport"] = c.transport
        pool = np.zeros((6, *LAYOUT.chunk_shape), np.float16)  # one region, six chunk views
        out["loaded"] = c.get(tokens, list(pool))
        out["exact"] = all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
                           for a, b in zip(chunks, pool, strict=True))  # fmt: skip
        # odd sizes by key: several segments and a tail that is not a whole block
        keys = [bytes([i]) * 16 for i in range(1, 4)]
        big = [rng.integers(0, 256, ODD_BYTES, dtype=np.uint8) for _ in keys]
        out["odd_stored"] = c.put_keys(keys, big, chunk_bytes=ODD_BYTES)
        dst = [bytearray(ODD_BYTES) for _ in keys]
        out["odd_loaded"] = c.get_keys(keys, dst, chunk_bytes=ODD_BYTES)
        out["odd_exact"] = all(bytes(d) == b.tobytes() for d, b in zip(dst, big, strict=True))
        # batches of more segments than the agent's staging slots, again and again (the loop
        # once stopped when every slot came free at once, storing part of a batch)
        big_keys = [bytes([0x80 + i]) * 16 for i in range(BATCH_CHUNKS)]
        srcs = [rng.integers(0, 256, BATCH_CHUNK_BYTES, dtype=np.uint8) for _ in big_keys]
        dsts = np.zeros((BATCH_CHUNKS, BATCH_CHUNK_BYTES), np.uint8)
        whole = []
        for _ in range(BATCH_ROUNDS):
            dsts.fill(0)
            stored = c.put_keys(big_keys, srcs, chunk_bytes=BATCH_CHUNK_BYTES)
            loaded = c.get_keys(big_keys, list(dsts), chunk_bytes=BATCH_CHUNK_BYTES)
            exact = all(np.array_equal(a, b) for a, b in zip(srcs, dsts, strict=True))
            whole.append([stored, loaded, exact])
            c.channel.pipeline([("delete", {"key": k}) for k in big_keys])
        out["batches"] = whole
        # a get into a buffer of another size is a miss, not a partial write
        out["wrong_size_loaded"] = c.get_keys(keys[:1], [bytearray(ODD_BYTES - 1)],
                                              chunk_bytes=ODD_BYTES - 1)  # fmt: skip
    return out


def _code(fn: Any) -> str:
    try:
        fn()
    except ControlError as e:
        return e.code
    return "ok"


def refused(url: str, token: str, admin_token: str) -> dict[str, Any]:
    """Descriptors outside what the session registered, another tenant's names and regions."""
    out: dict[str, Any] = {}
    host = NixlHostPath("default")
    key = [b"k" * 16]
    with ControlChannel(url, "default", token) as ch:
        ch.connect()
        out["get_before_connect"] = _code(
            lambda: ch.call("nixl_get", keys=key, targets=[[4096, 16]])
        )
        ch.call("nixl_connect", metadata=host.metadata())
        mine = np.zeros(1 << 20, np.uint8)
        added, _ = host.prepare([buffer_desc(mine, mine.nbytes, writable=True)])
        ch.call("nixl_register", metadata=host.metadata(), add=added, drop=[])
        other = np.zeros(1 << 20, np.uint8)  # never registered
        addr = int(other.ctypes.data)
        out["unregistered"] = _code(lambda: ch.call("nixl_get", keys=key, targets=[[addr, 4096]]))
        base = int(mine.ctypes.data)
        out["past_the_end"] = _code(
            lambda: ch.call("nixl_get", keys=key, targets=[[base + mine.nbytes - 100, 4096]])
        )
        out["inside"] = _code(lambda: ch.call("nixl_get", keys=key, targets=[[base, 4096]]))
        # put from an unregistered buffer: the agent must not READ it either
        out["put_unregistered"] = _code(
            lambda: ch.call("nixl_put", keys=key, sources=[[addr, 4096]], parents=[None])
        )
        with ControlChannel(url, "_admin", admin_token) as adm:
            adm.connect()
            t2 = adm.call("tenant_add", tenant="other")["token"]
        with ControlChannel(url, "other", t2) as ch2:
            ch2.connect()
            # tenant "other" claiming tenant default's host agent (its metadata)
            out["other_claims_default_agent"] = _code(
                lambda: ch2.call("nixl_connect", metadata=host.metadata())
            )
            thief = NixlHostPath("other")
            ch2.call("nixl_connect", metadata=thief.metadata())
            # tenant "other" targeting the buffer tenant default registered
            out["other_targets_default_buffer"] = _code(
                lambda: ch2.call("nixl_get", keys=key, targets=[[base, 4096]])
            )
    return out


def killed(url: str, token: str) -> dict[str, Any]:
    """Put chunks, then get them while the parent kills the agent once bytes are arriving."""
    keys = [(i + 1).to_bytes(16, "big") for i in range(KILL_CHUNKS)]
    with KVClient(url, "default", token, LAYOUT, SALT, transport="nixl", timeout_s=60) as c:
        src = np.full(KILL_CHUNK_BYTES, 0xAB, np.uint8)
        stored = c.put_keys(keys, [src] * KILL_CHUNKS, chunk_bytes=KILL_CHUNK_BYTES)
        pool = np.zeros((KILL_CHUNKS, KILL_CHUNK_BYTES), np.uint8)
        result: dict[str, Any] = {"stored": stored, "transport": c.transport}

        def get() -> None:
            result["loaded"] = c.get_keys(keys, list(pool), chunk_bytes=KILL_CHUNK_BYTES)

        t = threading.Thread(target=get)
        t.start()
        deadline = time.monotonic() + 60
        while not pool[0, :4096].any() and time.monotonic() < deadline:
            time.sleep(0.001)
        print("TRANSFERRING", flush=True)  # the parent kills the agent now
        t.join(120)
        result["arrived_chunks"] = int((pool[:, -1] == 0xAB).sum())
        result["next_get"] = c.get_keys(keys[:1], [pool[0]], chunk_bytes=KILL_CHUNK_BYTES)
    return result


LEGIT_CHUNKS, LEGIT_CHUNK_BYTES = 4, 1 << 20
LEGIT_RUN_MAX_S = 240  # a legit loop ends by itself even if its stop file never appears
FROZEN_CHUNK_BYTES = 32 << 20
KILLED_CHUNKS = 6  # 192 MiB: the get is still moving when the parent kills the worker


def legit(url: str, token: str, tenant: str, stop_file: str) -> dict[str, Any]:
    """Another tenant's client: put chunks, then get them again and again until `stop_file`
    exists; every answer is timed and compared byte for byte."""
    rng = np.random.default_rng(11)
    keys = [bytes([0x40 + i]) * 16 for i in range(LEGIT_CHUNKS)]
    srcs = [rng.integers(0, 256, LEGIT_CHUNK_BYTES, dtype=np.uint8) for _ in keys]
    out: dict[str, Any] = {"rounds": 0, "bad": [], "max_s": 0.0, "transports": []}
    with KVClient(url, tenant, token, LAYOUT, SALT, transport="nixl", timeout_s=60) as c:
        out["stored"] = c.put_keys(keys, srcs, chunk_bytes=LEGIT_CHUNK_BYTES)
        print("READY", flush=True)
        dst = np.zeros((LEGIT_CHUNKS, LEGIT_CHUNK_BYTES), np.uint8)
        end = time.monotonic() + LEGIT_RUN_MAX_S
        while not os.path.exists(stop_file) and time.monotonic() < end:
            dst.fill(0)
            t0 = time.monotonic()
            loaded = c.get_keys(keys, list(dst), chunk_bytes=LEGIT_CHUNK_BYTES)
            dt = time.monotonic() - t0
            exact = all(np.array_equal(a, b) for a, b in zip(srcs, dst, strict=True))
            out["rounds"] += 1
            out["max_s"] = max(out["max_s"], dt)
            if c.transport not in out["transports"]:
                out["transports"].append(c.transport)
            if loaded != LEGIT_CHUNKS or not exact:
                out["bad"].append([out["rounds"], loaded, exact, round(dt, 3)])
            time.sleep(0.02)
    return out


def frozen(url: str, token: str) -> dict[str, Any]:
    """Put one 32 MiB chunk, get it; once bytes arrive say TRANSFERRING (the parent stops this
    process with SIGSTOP and continues it later)."""
    key = [b"\xf0" * 16]
    with KVClient(url, "default", token, LAYOUT, SALT, transport="nixl", timeout_s=120) as c:
        src = np.full(FROZEN_CHUNK_BYTES, 0x5A, np.uint8)
        out: dict[str, Any] = {"stored": c.put_keys(key, [src], chunk_bytes=FROZEN_CHUNK_BYTES)}
        dst = np.zeros(FROZEN_CHUNK_BYTES, np.uint8)

        def get() -> None:
            out["loaded"] = c.get_keys(key, [dst], chunk_bytes=FROZEN_CHUNK_BYTES)

        t = threading.Thread(target=get)
        t.start()
        deadline = time.monotonic() + 60
        while not dst[:4096].any() and time.monotonic() < deadline:
            time.sleep(0.0005)
        print("TRANSFERRING", flush=True)
        t.join(180)
        out["transport"] = c.transport
    return out


def register_other(url: str, token: str, calls: int) -> dict[str, Any]:
    """nixl_register naming another host agent of the same tenant, `calls` times, each call
    another name (the other agent's metadata renamed: NIXL would load each as a new peer)."""
    import struct

    mine, other = NixlHostPath("default"), NixlHostPath("default")
    md = other.metadata()
    (n,) = struct.unpack_from("<Q", md, 16)
    rest = md[16 + 8 + n + 1 :]
    codes: dict[str, int] = {}
    with ControlChannel(url, "default", token) as ch:
        ch.connect()
        ch.call("nixl_connect", metadata=mine.metadata())
        for i in range(calls):
            name = f"dpukv.default.other-{i}".encode()
            renamed = b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name + b"|" + rest
            code = _code(lambda md=renamed: ch.call("nixl_register", metadata=md, add=[],
                                                    drop=[]))  # fmt: skip
            codes[code] = codes.get(code, 0) + 1
        print("DONE", flush=True)
        sys.stdin.readline()  # the parent counts the agent's fds while this session lives
    return {"codes": codes}


def worker_killed(url: str, token: str) -> dict[str, Any]:
    """A NIXL get in flight when the parent kills the agent's NIXL worker: the call gets an
    error reply; the session's next get (its metadata reloaded into a new worker) is whole."""
    keys = [bytes([0xA0 + i]) * 16 for i in range(KILLED_CHUNKS)]
    src = [np.full(FROZEN_CHUNK_BYTES, 0x30 + i, np.uint8) for i in range(KILLED_CHUNKS)]
    out: dict[str, Any] = {}
    with KVClient(url, "default", token, LAYOUT, SALT, transport="nixl", timeout_s=60) as c:
        out["stored"] = c.put_keys(keys, src, chunk_bytes=FROZEN_CHUNK_BYTES)
    host = NixlHostPath("default")
    pool = np.zeros((KILLED_CHUNKS, FROZEN_CHUNK_BYTES), np.uint8)
    with ControlChannel(url, "default", token, timeout_s=120) as ch:
        ch.connect()
        ch.call("nixl_connect", metadata=host.metadata())
        added, _ = host.prepare([buffer_desc(pool, pool.nbytes, writable=True)])
        ch.call("nixl_register", metadata=host.metadata(), add=added, drop=[])
        targets = [[int(pool[i].ctypes.data), FROZEN_CHUNK_BYTES] for i in range(KILLED_CHUNKS)]

        def get() -> None:
            try:
                out["first"] = ["ok", ch.call("nixl_get", keys=keys, targets=targets)["loaded"]]
            except ControlError as e:
                out["first"] = [e.code, e.message]

        t = threading.Thread(target=get)
        t.start()
        deadline = time.monotonic() + 60
        while not pool[0, :4096].any() and time.monotonic() < deadline:
            time.sleep(0.0005)
        print("TRANSFERRING", flush=True)  # the parent kills the worker now
        t.join(120)
        pool.fill(0)
        time.sleep(3)  # the agent restarts its worker and reloads this session's metadata
        try:
            out["next"] = ch.call("nixl_get", keys=keys, targets=targets)["loaded"]
        except ControlError as e:
            out["next"] = f"{e.code}: {e.message}"
        out["next_exact"] = all(bool((pool[i] == 0x30 + i).all()) for i in range(KILLED_CHUNKS))
    return out


PAUSED_ROUNDS_MAX = 200  # the loop ends by itself if the stop file never appears


def agent_paused(url: str, token: str, stop_file: str) -> dict[str, Any]:
    """Put 6 x 32 MiB under new keys and get them back, round after round, until `stop_file`
    exists; meanwhile the parent stops the agent (SIGSTOP) for longer than its transfer
    deadline and continues it, so one of these calls is in flight across the pause. This host
    did nothing wrong: every call must end whole, over NIXL."""
    src = [np.full(FROZEN_CHUNK_BYTES, 0x40 + i, np.uint8) for i in range(KILLED_CHUNKS)]
    dst = np.zeros((KILLED_CHUNKS, FROZEN_CHUNK_BYTES), np.uint8)
    out: dict[str, Any] = {"rounds": 0, "bad": [], "longest_s": 0.0, "transports": []}
    with KVClient(url, "default", token, LAYOUT, SALT, transport="nixl", timeout_s=120) as c:
        c.put_keys([b"\xbf" * 16], src[:1], chunk_bytes=FROZEN_CHUNK_BYTES)  # NIXL connected
        print("LOOPING", flush=True)  # the parent stops the agent during the loop
        end = time.monotonic() + LEGIT_RUN_MAX_S
        while (not os.path.exists(stop_file) and out["rounds"] < PAUSED_ROUNDS_MAX
               and time.monotonic() < end):  # fmt: skip
            r = out["rounds"] = out["rounds"] + 1
            keys = [bytes([r % 256, i]) * 8 for i in range(KILLED_CHUNKS)]
            dst.fill(0)
            t0 = time.monotonic()
            try:
                stored = c.put_keys(keys, src, chunk_bytes=FROZEN_CHUNK_BYTES)
                t1 = time.monotonic()
                loaded = c.get_keys(keys, list(dst), chunk_bytes=FROZEN_CHUNK_BYTES)
            except ControlError as e:
                out["bad"].append([r, f"{e.code}: {e.message}"])
                continue
            t2 = time.monotonic()
            out["longest_s"] = max(out["longest_s"], t1 - t0, t2 - t1)
            exact = all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
            if c.transport not in out["transports"]:
                out["transports"].append(c.transport)
            if stored != KILLED_CHUNKS or loaded != KILLED_CHUNKS or not exact:
                out["bad"].append([r, stored, loaded, exact])
    return out


def _unchecked(ch: ControlChannel, op: str, **fields: Any) -> str:
    """A call sent without the client's own field checks, as a hostile client would."""
    import host_shim.control as hc
    from kvproto.control import encode_frame

    real = hc.encode_request
    hc.encode_request = lambda rid, op, **f: encode_frame({"id": rid, "op": op, **f})
    try:
        return _code(lambda: ch.call(op, **fields))
    finally:
        hc.encode_request = real


def huge(url: str, token: str) -> dict[str, Any]:
    """Sizes far past anything registered: a 2^63-byte region, a 2^46-byte span."""
    host = NixlHostPath("default")
    key = [b"h" * 16]
    out: dict[str, Any] = {}
    with ControlChannel(url, "default", token) as ch:
        ch.connect()
        ch.call("nixl_connect", metadata=host.metadata())
        buf = np.zeros(1 << 20, np.uint8)
        added, _ = host.prepare([buffer_desc(buf, buf.nbytes, writable=False)])
        ch.call("nixl_register", metadata=host.metadata(), add=added, drop=[])
        base = int(buf.ctypes.data)
        t0 = time.monotonic()
        out["region_2_63"] = _unchecked(
            ch, "nixl_register", metadata=host.metadata(), add=[[base, 1 << 63, 0, "DRAM"]],
            drop=[],
        )  # fmt: skip
        out["region_not_registered"] = _code(lambda: ch.call(
            "nixl_register", metadata=host.metadata(), add=[[base, 1 << 30, 0, "DRAM"]], drop=[]
        ))  # fmt: skip
        out["put_2_46"] = _unchecked(
            ch, "nixl_put", keys=key, sources=[[base, 1 << 46]], parents=[None]
        )
        out["put_past_region"] = _code(lambda: ch.call(
            "nixl_put", keys=key, sources=[[base, 1 << 30]], parents=[None]
        ))  # fmt: skip
        out["refusals_s"] = time.monotonic() - t0
    return out


def regions(url: str, token: str) -> dict[str, Any]:
    """A region nested in another, and drops of addresses never registered."""
    from kvproto.control import NIXL_REGIONS_MAX

    host = NixlHostPath("default")
    out: dict[str, Any] = {}
    with ControlChannel(url, "default", token) as ch:
        ch.connect()
        ch.call("nixl_connect", metadata=host.metadata())
        buf = np.full(1 << 20, 0x5A, np.uint8)
        added, _ = host.prepare([buffer_desc(buf, buf.nbytes, writable=True)])
        md = host.metadata()
        ch.call("nixl_register", metadata=md, add=added, drop=[])
        base = int(buf.ctypes.data)
        ch.call("nixl_register", metadata=md, add=[[base + 16, 8, 0, "DRAM"]], drop=[])
        key = [b"n" * 16]
        # inside the first region, past the nested one
        out["put_past_nested"] = _code(
            lambda: ch.call("nixl_put", keys=key, sources=[[base + 4096, 4096]], parents=[None])
        )
        out["get_past_nested"] = _code(
            lambda: ch.call("nixl_get", keys=key, targets=[[base + 65536, 4096]])
        )
        out["got_bytes"] = bool((buf[65536 : 65536 + 4096] == 0x5A).all())
        # each call adds NIXL_REGIONS_MAX real sub-regions and "drops" as many never held
        fake = [[base + (2 << 20) + 64 * i, 8, 0, "DRAM"] for i in range(NIXL_REGIONS_MAX)]
        regions, codes = 2, []
        for call in range(3):
            sub = [[base + 32 + 64 * (call * NIXL_REGIONS_MAX + i), 8, 0, "DRAM"]
                   for i in range(NIXL_REGIONS_MAX)]  # fmt: skip
            try:
                regions = ch.call("nixl_register", metadata=md, add=sub, drop=fake)["regions"]
                codes.append("ok")
            except ControlError as e:
                codes.append(e.code)
        out["regions_max_seen"], out["codes"] = regions, codes
    return out


def reconnect(url: str, token: str) -> dict[str, Any]:
    """The control connection drops while a get is moving; the same host (same NIXL agent)
    connects again at once."""
    host = NixlHostPath("default")
    n, nbytes = 6, FROZEN_CHUNK_BYTES
    buf = np.full(n * nbytes, 0x33, np.uint8)
    keys = [bytes([0xA0 + i]) * 16 for i in range(n)]
    ch = ControlChannel(url, "default", token, timeout_s=120)
    ch.connect()
    ch.call("nixl_connect", metadata=host.metadata())
    added, _ = host.prepare([buffer_desc(buf, buf.nbytes, writable=True)])
    ch.call("nixl_register", metadata=host.metadata(), add=added, drop=[])
    base = int(buf.ctypes.data)
    spans = [[base + i * nbytes, nbytes] for i in range(n)]
    ch.call("nixl_put", keys=keys, sources=spans, parents=[None, *keys[:-1]])
    buf[:] = 0
    t = threading.Thread(target=lambda: _code(lambda: ch.call("nixl_get", keys=keys,
                                                               targets=spans)))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 60
    while not buf[:4096].any() and time.monotonic() < deadline:
        time.sleep(0.0005)
    out: dict[str, Any] = {"moving": bool(buf[:4096].any())}
    assert ch._sock is not None
    ch._sock.shutdown(socket.SHUT_RDWR)  # the host process lives on
    with ControlChannel(url, "default", token, timeout_s=60) as again:
        again.connect()
        out["reconnect"] = _code(lambda: again.call("nixl_connect", metadata=host.metadata()))
        # as NixlDataPath.attach: every region the host holds, learnt again by the agent
        out["register"] = _code(lambda: again.call(
            "nixl_register", metadata=host.metadata(), add=host.regions(), drop=[]
        ))  # fmt: skip
        buf[:] = 0
        got: dict[str, Any] = {}
        out["get"] = _code(lambda: got.update(again.call("nixl_get", keys=keys[:1],
                                                          targets=spans[:1])))  # fmt: skip
        out["loaded"] = got.get("loaded")
        out["bytes_ok"] = bool((buf[:nbytes] == 0x33).all())
    t.join(120)
    ch.close()
    return out


def metadata() -> dict[str, Any]:
    """A real host agent's metadata (hex), for the agent-side fuzz."""
    host = NixlHostPath("default")
    buf = np.zeros(1 << 20, np.uint8)
    host.prepare([buffer_desc(buf, buf.nbytes, writable=True)])
    print(json.dumps({"metadata": host.metadata().hex()}), flush=True)
    sys.stdin.readline()  # alive (its UCX address reachable) until the parent is done
    return {}


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    scenario, url, token = sys.argv[1:4]
    if scenario == "roundtrip":
        out = roundtrip(url, token)
    elif scenario == "refused":
        out = refused(url, token, sys.argv[4])
    elif scenario == "legit":
        out = legit(url, token, sys.argv[4], sys.argv[5])
    elif scenario == "frozen":
        out = frozen(url, token)
    elif scenario == "register_other":
        out = register_other(url, token, int(sys.argv[4]))
    elif scenario == "huge":
        out = huge(url, token)
    elif scenario == "worker_killed":
        out = worker_killed(url, token)
    elif scenario == "agent_paused":
        out = agent_paused(url, token, sys.argv[4])
    elif scenario == "metadata":
        out = metadata()
    elif scenario == "regions":
        out = regions(url, token)
    elif scenario == "reconnect":
        out = reconnect(url, token)
    else:
        out = killed(url, token)
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
