"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, `/v3/...`): range, transactions,
watch, user/password authentication and client TLS. The gateway ships in every etcd server
(Debian's `etcd-server` included), so this needs nothing beyond the standard library.

Every call has a deadline (ETCD_CALL_TIMEOUT_S); endpoints are tried in order, the first that
answers wins. Errors are EtcdError (the cluster refused: auth, bad request) or EtcdUnreachable
(no endpoint answered in time).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "ETCD_CALL_TIMEOUT_S",
    "EtcdClient",
    "EtcdError",
    "EtcdUnreachable",
    "EtcdWatch",
    "KeyValue",
]

# One etcd call on a LAN takes milliseconds (a Raft round for a write); 2 s bounds a black-holed
# endpoint without failing a slow fsync on a loaded etcd member.
ETCD_CALL_TIMEOUT_S = 2.0
ETCD_REPLY_BYTES_MAX = 8 << 20  # a range of every tenant record: 4096 x ~300 B, with headroom
ETCD_WATCH_LINE_BYTES_MAX = 1 << 20  # one watch event batch (the gateway sends one per line)


class EtcdError(Exception):
    """etcd answered with an error (authentication, permission, a bad request)."""


class EtcdUnreachable(EtcdError):
    """No endpoint answered within the deadline."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    assert raw and raw[-1] < 0xFF, prefix
    raw[-1] += 1
    return _b64(bytes(raw))


@dataclass(frozen=True, slots=True)
class _Endpoint:
    https: bool
    host: str
    port: int


def parse_endpoints(text: str) -> list[_Endpoint]:
    """`http://h:2379,https://h2:2379` -> endpoints; ValueError naming a bad one."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in "/":
            raise ValueError(f"etcd endpoint {item!r}: give http://HOST:PORT or https://HOST:PORT")
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(f"etcd endpoint {item!r}: bad port") from None
        out.append(_Endpoint(parts.scheme == "https", parts.hostname, port))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class EtcdClient:
    """Thread-safe: each call opens its own connection (a tenant change is rare; a pooled
    connection would need a lock held across I/O)."""

    def __init__(
        self,
        endpoints: str,
        *,
        user: str = "",
        password: str = "",
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = ETCD_CALL_TIMEOUT_S,
    ) -> None:
        self._endpoints = parse_endpoints(endpoints)
        self._user, self._password = user, password
        self._ssl = ssl_context
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards _token only, never held across I/O
        self._token = ""
        self._good = 0  # index of the endpoint that answered last (a race on it is harmless)

    # --- transport --------------------------------------------------------------------------
    def _connect(self, ep: _Endpoint, timeout_s: float) -> http.client.HTTPConnection:
        if ep.https:
            ctx = self._ssl or ssl.create_default_context()
            return http.client.HTTPSConnection(ep.host, ep.port, timeout=timeout_s, context=ctx)
        return http.client.HTTPConnection(ep.host, ep.port, timeout=timeout_s)

    def _open(
        self, path: str, body: dict[str, Any], timeout_s: float, *, auth: bool = True
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST to the first endpoint that answers; the response, not yet read."""
        headers = {"Content-Type": "application/json"}
        if auth and self._user:
            headers["Authorization"] = self._auth_token()
        data = json.dumps(body).encode()
        errors = []
        first = self._good  # the endpoint that answered last goes first: a dead one costs once
        n = len(self._endpoints)
        for i in (first + k for k in range(n)):
            ep = self._endpoints[i % n]
            conn = self._connect(ep, timeout_s)
            try:
                conn.request("POST", path, body=data, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                errors.append(f"{ep.host}:{ep.port}: {e or type(e).__name__}")
                continue
            self._good = i % n
            return conn, resp
        raise EtcdUnreachable("etcd unreachable: " + "; ".join(errors))

    def _call(self, path: str, body: dict[str, Any], *, auth: bool = True) -> dict[str, Any]:
        for attempt in range(2):  # a second try after re-authenticating (tokens expire)
            conn, resp = self._open(path, body, self.timeout_s, auth=auth)
            try:
                raw = resp.read(ETCD_REPLY_BYTES_MAX + 1)
            except (OSError, http.client.HTTPException) as e:
                raise EtcdUnreachable(f"etcd {path}: {e or type(e).__name__}") from None
            finally:
                conn.close()
            if len(raw) > ETCD_REPLY_BYTES_MAX:
                raise EtcdError(f"etcd {path}: reply over {ETCD_REPLY_BYTES_MAX} bytes")
            try:
                doc = json.loads(raw) if raw else {}
            except ValueError:
                raise EtcdError(f"etcd {path}: HTTP {resp.status}, not JSON") from None
            if resp.status == 200 and isinstance(doc, dict):
                return doc
            message = str(doc.get("message", raw[:200])) if isinstance(doc, dict) else ""
            if attempt == 0 and auth and self._user and "token" in message:
                with self._lock:
                    self._token = ""
                continue
            raise EtcdError(f"etcd {path}: HTTP {resp.status}: {message}")
        raise AssertionError("unreachable")

    def _auth_token(self) -> str:
        with self._lock:
            if self._token:
                return self._token
        doc = self._call(
            "/v3/auth/authenticate", {"name": self._user, "password": self._password}, auth=False
        )
        token = str(doc.get("token", ""))
        if not token:
            raise EtcdError("etcd authenticate: no token in the reply")
        with self._lock:
            self._token = token
        return token

    # --- key-value --------------------------------------------------------------------------
    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` and the store's revision at that read."""
        doc = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        try:
            kvs = [
                KeyValue(
                    key=base64.b64decode(kv["key"]).decode(),
                    value=base64.b64decode(kv.get("value", "")),
                    mod_revision=int(kv.get("mod_revision", 0)),
                )
                for kv in doc.get("kvs", [])
            ]
            return kvs, int(doc["header"]["revision"])
        except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise EtcdError(f"etcd range: unexpected reply ({type(e).__name__}: {e})") from None

    def create(self, key: str, value: bytes) -> bool:
        """Put `key` only if it does not exist; False when it does."""
        cmp = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        put = {"request_put": {"key": _b64(key), "value": _b64(value)}}
        return self._txn([cmp], [put])

    def replace(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Put `key` only if it was last written at `mod_revision`; False otherwise."""
        cmp = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}
        put = {"request_put": {"key": _b64(key), "value": _b64(value)}}
        return self._txn([cmp], [put])

    def delete(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only if it was last written at `mod_revision`; False otherwise."""
        cmp = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}
        return self._txn([cmp], [{"request_delete_range": {"key": _b64(key)}}])

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        doc = self._call("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(doc.get("succeeded", False))  # proto3 JSON leaves a false out

    def watch(self, prefix: str, start_revision: int, wait_s: float) -> EtcdWatch:
        """A watch on `prefix` from `start_revision`; see EtcdWatch."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "start_revision": start_revision,
            }
        }
        conn, resp = self._open("/v3/watch", body, wait_s)
        if resp.status != 200:
            conn.close()
            raise EtcdError(f"etcd watch: HTTP {resp.status}")
        return EtcdWatch(conn, resp)


class EtcdWatch:
    """A watch stream: `changed()` yields once per batch of events, then stops when nothing
    came for `wait_s` (the caller re-reads the state then: a change is only a hint to look
    again, and a quiet period is when the caller checks that etcd is still there)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self._conn, self._resp = conn, resp

    def changed(self) -> Iterator[int]:
        """The revision of each batch of events; ends on a quiet period or a broken stream."""
        while True:
            try:
                line = self._resp.readline(ETCD_WATCH_LINE_BYTES_MAX)
            except (OSError, http.client.HTTPException):
                return  # timeout (quiet) or broken: the caller re-reads either way
            if not line:
                return
            try:
                result = json.loads(line).get("result", {})
            except (ValueError, AttributeError):
                return
            if result.get("canceled") or result.get("compact_revision"):
                return
            if result.get("events"):
                yield int(result["header"]["revision"])

    def close(self) -> None:
        """Safe from another thread: a shutdown wakes a reader blocked on the socket."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
