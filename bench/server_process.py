"""Launch a real `turnstile serve` on free loopback ports, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from turnstile.launcher import healthy


def _lowest_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """`count` consecutive free loopback ports, from below the kernel's ephemeral range: a port
    that bind(0) picked can be taken again by any outgoing connection before the server binds it
    (a CI run lost the executor's metrics port, the one after the scheduler's, that way)."""
    low = _lowest_ephemeral_port()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                sockets.append(probe)
                probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
        return list(range(base, base + count))
    raise RuntimeError(f"no {count} consecutive free ports below {low}")


@dataclass(slots=True)
class Server:
    url: str
    metrics_port: int  # the scheduler's; the executor's is the next one
    process: subprocess.Popen[bytes]
    scheduler_address: str  # where gateways connect
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

    def service(self, name: str) -> psutil.Process:
        """The child process running one service (its title: `turnstile NAME`)."""
        import psutil  # a test and benchmark dependency, not the server's

        children = psutil.Process(self.process.pid).children()
        found = [c for c in children if c.cmdline()[:1] == [f"turnstile {name}"]]
        if not found:
            raise LookupError(f"no {name} process under turnstile serve")
        return found[0]


@contextlib.contextmanager
def launched_server(
    *extra: str,
    ready_timeout: float = 180,
    quiet: bool = True,
    env: dict[str, str] | None = None,
    addresses: bool = True,
    log: Path | None = None,
) -> Iterator[Server]:
    """`turnstile serve` with `extra` options; `addresses`: name its ZeroMQ sockets, so that
    tests can reach them, else leave them to serve (then `Server`'s addresses are empty);
    `log`: where its log (stderr) goes."""
    # metrics is the scheduler's port; the executor serves on the next one, reserved here too.
    http, metrics, _ = free_ports(3)
    run_dir = Path(tempfile.mkdtemp(prefix="turnstile-test-"))  # 0700, as serve's own
    scheduler, executors = f"ipc://{run_dir}/scheduler.sock", f"ipc://{run_dir}/executors.sock"
    named = ["--scheduler-address", scheduler, "--executors-address", executors]
    command = [
        sys.executable, "-m", "turnstile.cli", "serve",
        "--port", str(http), "--metrics-port", str(metrics), *(named if addresses else []),
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "TURNSTILE_LOG": "WARNING", **(env or {})}
    output = subprocess.DEVNULL if quiet else None
    errors = open(log, "wb") if log is not None else None  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, env=env, stdout=output, stderr=errors)
    url = f"{'https' if '--ssl-certfile' in extra else 'http'}://127.0.0.1:{http}"
    deadline = time.monotonic() + ready_timeout
    try:
        while not healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"turnstile serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("turnstile serve did not become ready")
            time.sleep(0.05)
        if not addresses:
            scheduler = executors = ""
        yield Server(url, metrics, process, scheduler, executors)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
        if errors is not None:
            errors.close()
