"""The /metrics endpoint: a few connections at a time, each dropped when idle.

prometheus_client's own server starts a thread per connection and waits on
each for ever: any user who can reach the port (on loopback, anyone logged in
on the host) held 1,000 idle connections, the root daemon ran out of file
descriptors and every cycle failed (`Too many open files`; an adversarial
probe, 2026-12-07). Here a connection beyond `max_connections` is closed at
once, and one still open `timeout_s` after it was accepted is cut, however
slowly it sends, so the daemon holds at most `max_connections` sockets (and
twice as many threads) for metrics whatever is done to the port. A scraper (Prometheus: one request every few
seconds) needs one.
"""

from __future__ import annotations

import http.server
import socket
import socketserver
import threading
from typing import Any

MAX_CONNECTIONS = 8
TIMEOUT_S = 5.0


def _handler(registry: Any, timeout_s: float) -> type[http.server.BaseHTTPRequestHandler]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class MetricsHandler(http.server.BaseHTTPRequestHandler):
        timeout = timeout_s           # socket timeout: an idle client is dropped

        def handle(self) -> None:
            # And a whole-connection deadline: a client trickling a byte a second never trips the socket
            # timeout, and eight of them held every slot (a probe, 2026-12-07).
            deadline = threading.Timer(timeout_s, self._cut)
            deadline.daemon = True
            deadline.start()
            try:
                super().handle()
            finally:
                deadline.cancel()

        def _cut(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def do_GET(self) -> None:     # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 (http.server's name)
            pass                      # a scrape every few seconds is not worth a log line

    return MetricsHandler


class BoundedServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A threading HTTP server that serves at most `max_connections` connections at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler], *,
                 family: int, max_connections: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)      # full: closed at once, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(registry: Any, port: int, addr: str, *, max_connections: int = MAX_CONNECTIONS,
          timeout_s: float = TIMEOUT_S) -> BoundedServer:
    """Serve `registry` on addr:port in a daemon thread; the server (its `server_address` names the port)."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    server = BoundedServer((addr, port), _handler(registry, timeout_s), family=family,
                           max_connections=max_connections)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
