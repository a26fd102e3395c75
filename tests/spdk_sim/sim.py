"""A simulator of SPDK v26.05's JSON-RPC server on a Unix socket, for tests and demos.

It behaves as the recordings in shared/spdk/ show a real `spdk_tgt` behaving (copied into
`sim_data_v26_05.json` by tests/spdk_sim/make_sim_data.py): compact JSON replies ending in a
newline, batches answered as arrays, notifications unanswered, string ids echoed, malformed
JSON closing the connection, and per-method parameter decoding (unknown, mistyped or missing
parameters) failing with the code and message SPDK gives. Object semantics (bdevs, claims,
keys, lvstores, nvmf) live in `spdk_sim._sim_target`. Threaded: one thread per connection,
one lock around the target state, as SPDK serialises RPCs on its app thread.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spdk_plugins._log import get_logger
from spdk_sim._sim_common import NvmeDevice, RpcFail, load_sim_data
from spdk_sim._sim_target import SimTarget

__all__ = ["NvmeDevice", "SpdkSimulator"]

_log = get_logger("spdk_plugins.sim")

# SPDK's JSON-RPC server caps one request buffer (SPDK_JSONRPC_RECV_BUF_SIZE_MAX is 32 MiB);
# the simulator's requests are tiny, 4 MiB is plenty and bounds a test gone wrong.
REQUEST_BYTES_MAX = 4 * 1024 * 1024
CONNECTIONS_MAX = 64  # SPDK_JSONRPC_MAX_CONNS
RECV_CHUNK_BYTES = 65536
ERR_INVALID_REQUEST = -32600


class SpdkSimulator:
    """`with SpdkSimulator(path) as sim:` serves until the block ends."""

    def __init__(
        self,
        socket_path: str | Path,
        *,
        uuid_factory: Callable[[], str] | None = None,
        file_sizes: dict[str, int] | None = None,
        nvme_devices: dict[str, NvmeDevice] | None = None,
        features: frozenset[str] = frozenset(),
        wait_for_rpc: bool = False,
    ) -> None:
        self.socket_path = str(socket_path)
        self.target = SimTarget(
            load_sim_data(),
            uuid_factory=uuid_factory,
            file_sizes=file_sizes or {},
            nvme_devices=nvme_devices or {},
            features=features,
            wait_for_rpc=wait_for_rpc,
        )
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []  # every decoded request, for tests
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()

    def __enter__(self) -> SpdkSimulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(CONNECTIONS_MAX)
        self._listener = listener
        t = threading.Thread(target=self._accept_loop, name="spdk-sim-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._conns_lock:
                full = len(self._conns) >= CONNECTIONS_MAX
                if not full:
                    self._conns.add(conn)
            if full:
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket) -> None:
        buf = ""
        try:
            while not self._stopping.is_set():
                data = conn.recv(RECV_CHUNK_BYTES)
                if not data:
                    return
                buf += data.decode("utf-8", errors="replace")
                if len(buf) > REQUEST_BYTES_MAX:
                    return
                for item in _split_values(buf):
                    if item is _MALFORMED:
                        return  # SPDK closes the connection without a reply
                    if isinstance(item, _Rest):
                        buf = item.text  # incomplete: wait for more bytes
                        break
                    reply = self.handle(item)
                    if reply is not None:
                        out = json.dumps(reply, separators=(",", ":"), ensure_ascii=False)
                        conn.sendall((out + "\n").encode())
                else:
                    buf = ""
        except OSError:
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def handle(self, request: Any) -> Any:
        """One decoded JSON value (object or batch array) -> the reply value, or None."""
        if isinstance(request, list):
            replies = [r for r in (self._handle_one(x) for x in request) if r is not None]
            return replies or None
        return self._handle_one(request)

    def _handle_one(self, req: Any) -> dict[str, Any] | None:
        if not isinstance(req, dict) or not isinstance(req.get("method"), str):
            rid = req.get("id") if isinstance(req, dict) else None
            return _error(rid, ERR_INVALID_REQUEST, "Invalid request")
        has_id = "id" in req
        rid = req.get("id")
        with self.lock:
            self.requests.append(req)
            try:
                result = self.target.dispatch(req["method"], req.get("params"))
            except RpcFail as e:
                return _error(rid, e.code, e.message) if has_id else None
        if not has_id:
            return None
        return {"jsonrpc": "2.0", "id": rid, "result": result}


def _error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


_MALFORMED = object()


class _Rest:
    def __init__(self, text: str) -> None:
        self.text = text


_DECODER = json.JSONDecoder()


_LITERALS = ("true", "false", "null")
_NUMBER_PREFIX = re.compile(r"-?[0-9]*\.?[0-9]*([eE][+-]?[0-9]*)?")


def _incomplete(buf: str, e: json.JSONDecodeError) -> bool:
    """Whether the decode error means "wait for more bytes" rather than a syntax error."""
    if e.pos >= len(buf.rstrip()) or e.msg.startswith("Unterminated string"):
        return True
    tail = buf[e.pos :]
    return any(lit.startswith(tail) for lit in _LITERALS) or bool(_NUMBER_PREFIX.fullmatch(tail))


def _split_values(buf: str) -> Iterator[Any]:
    """Yield each complete JSON value in buf; then the incomplete rest (_Rest) or _MALFORMED."""
    pos = 0
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n":
            pos += 1
        if pos == len(buf):
            return
        try:
            value, end = _DECODER.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            yield _Rest(buf[pos:]) if _incomplete(buf, e) else _MALFORMED
            return
        yield value
        pos = end
