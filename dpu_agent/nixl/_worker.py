"""The process that runs the agent's NIXL agent, so that NIXL or UCX aborting costs only it.

NIXL and UCX assert on input they do not expect and abort the process. The agent checks a
peer's metadata first (dpu_agent.nixl._metadata), and runs NIXL here besides: a child process
that maps the agent's staging memory (a memfd both processes map, registered with NIXL here)
and moves bytes between it and hosts on the agent's orders. The agent decrypts into and
encrypts out of the same pages, so no byte is copied between the processes; only small
commands cross the socket. If this process dies, the agent fails the calls in flight, starts a
new one and loads the sessions' metadata into it again (dpu_agent.nixl._server).

Commands (pickled tuples over a socketpair; the agent is the only peer):
    ("md", rid)                              -> this agent's NIXL metadata
    ("load", rid, metadata)                  -> the host agent's name (add_remote_agent)
    ("remove", rid, name)                    -> None (remove_remote_agent)
    ("xfer", rid, op, off, n, addr, dev, mem, remote) -> "DONE" or "ERR" once the transfer ended,
                                             in a ("done", 0, [(rid, state), ...]) batch
    ("ping", rid)                            -> None (the agent's watchdog; a worker stuck in
                                             NIXL or UCX does not answer and is killed)
Replies: ("ok", rid, value) or ("err", rid, message).

Run: python -m dpu_agent.nixl._worker SOCK_FD SHM_FD SHM_BYTES NAME
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# While transfers are in flight the loop waits this long for a command between rounds of
# progress. Polling with no wait spun a whole core, one of the DPU's few, that the decrypting
# threads beside it need; UCX over TCP keeps a 4 MiB WRITE moving with a round every 50 us
# (the socket buffers hold more than 50 us of the wire), and a completion is seen at most this
# late.
PROGRESS_WAIT_S = 50e-6


def _serve(conn: Connection, agent: Any, base: int) -> None:
    inflight: dict[int, tuple[Any, str]] = {}  # rid -> (handle, remote)
    while True:
        if not inflight or conn.poll(PROGRESS_WAIT_S):
            try:
                msg = conn.recv()
            except EOFError:  # the agent is gone: so is our purpose
                return
            _command(conn, agent, base, inflight, msg)
            continue
        done = []
        for rid, (h, _remote) in inflight.items():
            try:
                st = str(agent.check_xfer_state(h))
            except Exception:  # its remote was removed under it: it ended
                st = "ERR"
            if st != "PROC":
                done.append((rid, h, "DONE" if st == "DONE" else "ERR"))
        for rid, h, _st in done:
            del inflight[rid]
            try:
                agent.release_xfer_handle(h)
            except Exception:  # ended with its remote: nothing left to free
                pass
        if done:  # one message for every transfer that ended in this round
            conn.send(("done", 0, [(rid, st) for rid, _h, st in done]))


def _command(
    conn: Connection, agent: Any, base: int, inflight: dict[int, tuple[Any, str]], msg: tuple
) -> None:
    kind, rid = msg[0], msg[1]
    try:
        if kind == "xfer":
            _, _, op, off, n, addr, dev, mem, remote = msg
            local = agent.get_xfer_descs([(base + off, n, 0)], "DRAM")
            far = agent.get_xfer_descs([(addr, n, dev)], mem)
            h = agent.initialize_xfer(op, local, far, remote)
            if agent.transfer(h) == "ERR":
                agent.release_xfer_handle(h)
                conn.send(("ok", rid, "ERR"))
            else:
                inflight[rid] = (h, remote)
            return
        if kind == "ping":  # the agent's watchdog: this loop still turns
            value: Any = None
        elif kind == "md":
            value = bytes(agent.get_agent_metadata())
        elif kind == "load":
            loaded = agent.add_remote_agent(msg[2])
            value = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        elif kind == "remove":
            agent.remove_remote_agent(msg[2])
            value = None
        else:
            raise ValueError(f"unknown command {kind!r}")
    except Exception as e:  # NIXL refused it (a Python exception, not an abort): say so
        conn.send(("err", rid, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", rid, value))


def main(argv: list[str]) -> int:
    sock_fd, shm_fd, shm_bytes, name = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    faulthandler.register(signal.SIGUSR1)  # the watchdog logs where a stuck worker is stuck
    from host_shim.transport import new_agent  # after argv: a usage error costs no NIXL start

    mem = mmap.mmap(shm_fd, shm_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(shm_fd)
    staging = np.frombuffer(mem, np.uint8)
    agent = new_agent(name, progress_thread=False)  # this process polls while it transfers
    agent.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")
    conn = Connection(socket.socket(fileno=sock_fd).detach())
    conn.send(("ok", 0, bytes(agent.get_agent_metadata())))  # ready
    _serve(conn, agent, staging.ctypes.data)
    os._exit(0)  # NIXL's teardown at exit is not needed: the process ends here


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
