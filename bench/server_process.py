"""Launch a real `turnstile serve` on free loopback ports, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from turnstile.launcher import healthy


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass(slots=True)
class Server:
    url: str
    metrics_port: int  # the scheduler's; the executor's is the next one
    process: subprocess.Popen[bytes]
    requests_address: str
    executors_address: str

    def scrape(self, port: int | None = None) -> dict[str, float]:
        """Every sample of one service's /metrics, by its full name with labels."""
        target = f"http://127.0.0.1:{port or self.metrics_port}/metrics"
        with urllib.request.urlopen(target, timeout=5) as response:
            text = response.read().decode()
        series = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                series[name] = float(value)
        return series


@contextlib.contextmanager
def launched_server(
    *extra: str, ready_timeout: float = 180, quiet: bool = True, env: dict[str, str] | None = None
) -> Iterator[Server]:
    http, requests, outputs, executors, metrics, _ = free_ports(6)
    command = [
        sys.executable, "-m", "turnstile.cli", "serve",
        "--port", str(http), "--metrics-port", str(metrics),
        "--requests-address", f"tcp://127.0.0.1:{requests}",
        "--outputs-address", f"tcp://127.0.0.1:{outputs}",
        "--executors-address", f"tcp://127.0.0.1:{executors}",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "TURNSTILE_LOG": "WARNING", **(env or {})}
    output = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(command, env=env, stdout=output)
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + ready_timeout
    try:
        while not healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"turnstile serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("turnstile serve did not become ready")
            time.sleep(0.2)
        yield Server(
            url, metrics, process, f"tcp://127.0.0.1:{requests}", f"tcp://127.0.0.1:{executors}"
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
