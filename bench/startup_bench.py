"""`turnstile bench startup`: seconds from launching `turnstile serve` to the first answered
chat completion, over several cold process starts (model caches already built)."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

from turnstile.bench.server_process import launched_server


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
        started = time.monotonic()
        # launched_server returns once /health is 200; the first answer comes right after.
        with launched_server(quiet=True) as server:
            _first_answer(server.url, started + 120)
            seconds.append(time.monotonic() - started)
    return seconds


def report(runs: int) -> str:
    seconds = measure(runs)
    listed = ", ".join(f"{s:.1f}" for s in seconds)
    return f"first answer after {statistics.median(seconds):.1f} s (median of {listed})"
