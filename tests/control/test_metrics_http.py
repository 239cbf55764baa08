"""The daemon's /metrics endpoint holds a bounded number of connections and threads, whatever a client does."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from slurm_elastic.control import metrics_http
from slurm_elastic.control.metrics import ControllerMetrics


def _scrape(port: int, path: str = "/metrics", within_s: float = 30.0) -> str:
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                return response.read().decode()
        except urllib.error.HTTPError:
            raise
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def _served(clients: int = 0) -> Iterator[tuple[int, list[socket.socket]]]:
    """A fresh controller's metrics served on a free port, with `clients` connections opened to it that send
    nothing yet: (the port, their sockets). The sockets and the server are closed after."""
    server = ControllerMetrics().serve(0)
    port = server.server_address[1]
    socks: list[socket.socket] = []
    try:
        for _ in range(clients):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        yield port, socks
    finally:
        for sock in socks:
            sock.close()
        server.shutdown()
        server.server_close()


def test_it_serves_the_registry_and_nothing_else():
    with _served() as (port, _):
        families = {f.name for f in text_string_to_metric_families(_scrape(port))}
        assert {"slurm_elastic_cycle_seconds", "slurm_elastic_gpus", "slurm_elastic_plans"} <= families
        try:
            _scrape(port, "/etc/passwd")
            raise AssertionError("served a path that is not /metrics")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404


def test_idle_connections_cost_at_most_the_bound_and_are_dropped():
    """Many clients that connect and send nothing (the probe held 1,000 and the daemon ran out of file
    descriptors): the server keeps at most its bound of them, in as many threads, drops those after the idle
    timeout, and serves a scrape again."""
    before = threading.active_count()
    with _served(10 * metrics_http.MAX_CONNECTIONS) as (port, idle):
        time.sleep(1.0)
        # the serving thread and at most two threads (its handler, its deadline) per connection it kept
        assert threading.active_count() <= before + 1 + 2 * metrics_http.MAX_CONNECTIONS
        closed = 0
        for sock in idle:
            sock.settimeout(metrics_http.TIMEOUT_S + 10)
            try:
                closed += sock.recv(1) == b""    # the server closed it: at once, or once idle too long
            except ConnectionResetError:
                closed += 1
        assert closed == len(idle)
        assert "slurm_elastic_gpus" in _scrape(port)


def test_a_client_trickling_bytes_is_cut_at_the_deadline():
    """Eight clients sending a byte every second never trip a per-read timeout and held every slot (a probe):
    each connection is cut once it has been open for the timeout, whatever it sends."""
    with _served(metrics_http.MAX_CONNECTIONS) as (port, slow):
        started = time.monotonic()
        cut = 0
        while time.monotonic() - started < metrics_http.TIMEOUT_S + 20 and cut < len(slow):
            cut = 0
            for sock in slow:
                try:
                    sock.sendall(b"G")
                except OSError:
                    cut += 1
            time.sleep(1.0)
        assert cut == len(slow)
        assert "slurm_elastic_gpus" in _scrape(port)
