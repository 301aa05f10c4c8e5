"""A /metrics endpoint in Prometheus's text format, on a background thread.

prometheus_client's own server negotiates OpenMetrics with Prometheus 2.x and then rewrites
`turnstile:name` as `turnstile_name`; the text format keeps the names users query.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from turnstile.shared.config import MetricsConfig


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
