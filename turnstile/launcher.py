"""`turnstile serve`: the scheduler, the executor and the gateway as child processes of one
command, which waits for readiness, prints the URL, and stops them all on Ctrl-C / SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "turnstile.cli", *args])


MAX_RESTARTS = 5  # within RESTART_WINDOW seconds, per service; then everything stops
RESTART_WINDOW = 60.0
DRAIN_SECONDS = 65.0  # the gateway's own drain limit, plus a margin


def launch(
    common: list[str],
    gateway: list[str],
    scheduler: list[str],
    executor: list[str],
    url: str,
    ready_timeout: float,
) -> int:
    """Start everything, wait for /health, then supervise: a service that dies is started
    again (the scheduler re-queues the work of a lost executor), until a signal arrives."""
    commands = [
        ["scheduler", *common, *scheduler],
        ["executor", *common, *executor],
        ["gateway", *common, *gateway],
    ]
    children = [_spawn(command) for command in commands]
    restarts: list[list[float]] = [[] for _ in commands]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    announced = False
    code = 0
    while not stopping:
        for index, child in enumerate(children):
            if child.poll() is None:
                continue
            now = time.monotonic()
            restarts[index] = [t for t in restarts[index] if now - t < RESTART_WINDOW] + [now]
            name = commands[index][0]
            if len(restarts[index]) > MAX_RESTARTS:
                print(f"turnstile: {name} keeps dying; stopping", file=sys.stderr)
                stopping, code = True, 1
                break
            print(f"turnstile: {name} exited ({child.returncode}); restarting", file=sys.stderr)
            children[index] = _spawn(commands[index])
        if not announced and not stopping:
            if healthy(url):
                ready_in = time.monotonic() - started
                print(f"Turnstile is serving at {url} (ready in {ready_in:.1f} s)", flush=True)
                announced = True
            elif time.monotonic() - started > ready_timeout:
                print("turnstile: not ready in time; stopping", file=sys.stderr)
                code = 1
                break
        time.sleep(0.2)
    # The gateway goes first and drains: requests under way finish while the scheduler and the
    # executors still run; then the rest stop.
    gateway = children[-1]
    if gateway.poll() is None:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(timeout=DRAIN_SECONDS)
        except subprocess.TimeoutExpired:
            gateway.kill()
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
    return code


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
