"""`turnstile bench startup`: seconds from launching `turnstile serve` to the first answered
chat completion, over several cold process starts (model caches already built)."""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _first_answer(url: str, deadline: float) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("no answer")


def measure(runs: int = 3) -> list[float]:
    seconds = []
    for _ in range(runs):
        http, base = _free_port(), _free_port()
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "turnstile.cli", "serve", "--port", str(http),
             "--metrics-port", str(_free_port()),
             "--requests-address", f"tcp://127.0.0.1:{base}",
             "--outputs-address", f"tcp://127.0.0.1:{_free_port()}",
             "--executors-address", f"tcp://127.0.0.1:{_free_port()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _first_answer(f"http://127.0.0.1:{http}", started + 120)
            seconds.append(time.monotonic() - started)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    return seconds


def report(runs: int) -> str:
    seconds = measure(runs)
    listed = ", ".join(f"{s:.1f}" for s in seconds)
    return f"first answer after {statistics.median(seconds):.1f} s (median of {listed})"
