"""The agent's /metrics listener: prometheus_client's WSGI app behind a bounded server.

prometheus_client's own `start_http_server` starts a thread per connection and waits on each
for as long as its peer likes: on a DPU, where the metrics port faces the management network,
a stranger holding idle sockets held as many threads and descriptors as it opened (1,000 idle
sockets: 1,000 threads, and a scrape's connect waiting a second in the listen backlog), and
enough of them would take the descriptors the journal and the tenants' connections need.

Here a connection lives at most METRICS_CONNECTION_DEADLINE_S (a scrape is one request of a
few hundred bytes and an answer of some tens of KB: milliseconds), one address holds at most
METRICS_CONNECTIONS_PER_ADDRESS_MAX and all together METRICS_CONNECTIONS_MAX. A newcomer over
either bound closes the oldest connection it competes with, never itself: a flood must outpace
every scraper's one round trip to keep it out.
"""

from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from dpu_agent.metrics import REGISTRY, Counter

__all__ = [
    "METRICS_CONNECTIONS_MAX",
    "METRICS_CONNECTIONS_PER_ADDRESS_MAX",
    "METRICS_CONNECTION_DEADLINE_S",
    "MetricsServer",
    "start_metrics_server",
]

# Scrapers: an HA pair of Prometheus servers, an exporter or two, a human with curl
METRICS_CONNECTIONS_MAX = 64
METRICS_CONNECTIONS_PER_ADDRESS_MAX = 8
# A scrape takes milliseconds on loopback and well under a second across a management network
METRICS_CONNECTION_DEADLINE_S = 10.0
# Connections waiting in the kernel for accept(): a burst of scrapers, not a flood
LISTEN_BACKLOG = 128
REAP_INTERVAL_S = 0.5  # serve_forever's poll: how often deadlines are looked at

CLOSED = Counter(
    "kvtier_metrics_connections_closed",
    "Metrics connections the agent closed: reason deadline (no whole scrape within "
    "METRICS_CONNECTION_DEADLINE_S), connections_max or address_max (the oldest, for a newcomer)",
    ["reason"],
    registry=REGISTRY,
)


class _Handler(WSGIRequestHandler):
    """One request per connection (wsgiref's), no access log."""

    timeout = METRICS_CONNECTION_DEADLINE_S  # each recv/send; the whole is the reaper's

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, bounded in number and lifetime (module docstring)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    deadline_s = METRICS_CONNECTION_DEADLINE_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[str, float]] = {}  # conn -> (address, accepted)
        super().__init__(*args, **kwargs)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        host = str(client_address[0])
        now = time.monotonic()
        with self._lock:
            mine = [c for c, (h, _) in self._open.items() if h == host]
            if len(mine) >= METRICS_CONNECTIONS_PER_ADDRESS_MAX:
                self._evict(min(mine, key=lambda c: self._open[c][1]), "address_max")
            elif len(self._open) >= METRICS_CONNECTIONS_MAX:
                self._evict(min(self._open, key=lambda c: self._open[c][1]), "connections_max")
            self._open[request] = (host, now)
        return True

    def service_actions(self) -> None:
        """Close connections past their deadline (serve_forever calls it every poll)."""
        cutoff = time.monotonic() - self.deadline_s
        with self._lock:
            for c in [c for c, (_, t) in self._open.items() if t < cutoff]:
                self._evict(c, "deadline")

    def _evict(self, conn: socket.socket, reason: str) -> None:
        """Wake the connection's thread (its recv returns EOF, its send fails) and forget it;
        the thread closes the socket. Under self._lock."""
        del self._open[conn]
        CLOSED.labels(reason).inc()
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that timed out, hung up or was evicted: nothing to log (the base prints a
        traceback per connection, which a flood would turn into a flood of lines)."""

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry = REGISTRY
) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread; OSError if the port
    cannot be bound. Stop with `shutdown()` then `server_close()`."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)

    class _Server(MetricsServer):
        address_family = family[0][0]

    httpd = make_server(host, port, make_wsgi_app(registry), _Server, handler_class=_Handler)
    assert isinstance(httpd, MetricsServer)
    threading.Thread(
        target=httpd.serve_forever, args=(REAP_INTERVAL_S,), name="metrics-http", daemon=True
    ).start()
    return httpd
