"""A /metrics endpoint in Prometheus's text format, on a background thread; and the series of
every service of one stack, for the gateway's /metrics.

prometheus_client's own server negotiates OpenMetrics with Prometheus 2.x and then rewrites
`turnstile:name` as `turnstile_name`; the text format keeps the names users query.

`turnstile serve` gives its services one directory (prometheus_client's multiprocess mode, as
vLLM's API server does): each process writes its series there as well, and one port serves them
all. Gauges say how values of several processes combine (`multiprocess_mode`).
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from turnstile.shared.config import MetricsConfig

SHARED_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client at import


def every_service_metrics() -> bytes:
    """The series of every process sharing this one's metrics directory; without one, this
    process's own."""
    if not os.environ.get(SHARED_DIR_VARIABLE):
        return generate_latest()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        body = generate_latest()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_metrics(config: MetricsConfig) -> ThreadingHTTPServer | None:
    """Serve /metrics where `config` says; nothing without a port."""
    if config.metrics_port is None:
        return None
    server = ThreadingHTTPServer((config.metrics_host, config.metrics_port), _MetricsHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
