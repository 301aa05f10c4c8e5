"""Monitoring end to end: a real Prometheus scrapes a live stack, the bench client's figures match
the server's own counters, static batches fill as `bench compare` assumes."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack or loads models

# A series of each service, which the gateway's /metrics carries too (vLLM's names where it has
# them: num_requests_running, num_requests_waiting, kv_cache_usage_perc).
EVERY_SERVICE = {
    "turnstile:num_requests_running", "turnstile:num_requests_waiting",
    "turnstile:kv_cache_usage_perc", "turnstile:generation_tokens_total",
    "turnstile:executor_forward_seconds_count", "turnstile:executor_idle_seconds_count",
    "turnstile:gateway_generation_tokens_total", "turnstile:time_to_first_token_seconds_count",
}  # fmt: skip


def test_a_real_prometheus_scrapes_every_service(service: Server, tmp_path: Path) -> None:
    """Debian's prometheus (installed by `make test`) scrapes gateway, scheduler and executor;
    the series are read back through its HTTP API."""
    import shutil
    import urllib.parse
    import urllib.request

    from turnstile.bench.server_process import free_ports

    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make test` installs Debian's package"
    (port,) = free_ports(1)
    gateway = service.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "gateway", "static_configs": [{"targets": [gateway]}]},
            {"job_name": "scheduler",
             "static_configs": [{"targets": [f"127.0.0.1:{service.metrics_port}"]}]},
            {"job_name": "executor",
             "static_configs": [{"targets": [f"127.0.0.1:{service.metrics_port + 1}"]}]},
        ],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    prometheus = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def query(expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]

    try:
        openai.OpenAI(base_url=f"{service.url}/v1", api_key="x").completions.create(
            model=MODEL, prompt="Prometheus test", max_tokens=7, temperature=0
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                up = {r["metric"]["job"]: r["value"][1] for r in query("up")}
                tokens = query("turnstile:generation_tokens_total")
                gateway_tokens = query("turnstile:gateway_generation_tokens_total")
                executor_steps = query("turnstile:executor_forward_seconds_count")
                # Async scheduling, seen: the executor's waits between plans, counted.
                idle = query("turnstile:executor_idle_seconds_count")
                ahead = query("turnstile:scheduler_plans_in_flight")
                # One scrape target: the gateway's port also carries the others' series.
                named = query('{job="gateway", __name__=~"turnstile:.*"}')
                on_gateway = {r["metric"]["__name__"] for r in named}
                if (
                    up == {"gateway": "1", "scheduler": "1", "executor": "1"}
                    and tokens
                    and (gateway_tokens and executor_steps and idle and ahead)
                    and on_gateway >= EVERY_SERVICE
                ):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never saw all three services"
            time.sleep(0.5)
        # The scheduler also counts tokens generated for clients that left before reading them.
        assert float(tokens[0]["value"][1]) >= float(gateway_tokens[0]["value"][1]) >= 7
        assert float(executor_steps[0]["value"][1]) > 0
        assert float(idle[0]["value"][1]) >= float(executor_steps[0]["value"][1]) - 1
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)


def test_bench_client_agrees_with_the_servers_prometheus_counters(server_for_bench: Server) -> None:
    from turnstile.bench import serve_bench

    before = server_for_bench.scrape()
    jobs = serve_bench.make_jobs("longtail", 12, 16, 8, seed=3)
    outcomes, duration = serve_bench.run_load(
        server_for_bench.url, MODEL, jobs, float("inf"), 8, 0, progress=False
    )
    summary = serve_bench.summarize(outcomes, duration, slo_ttft=60, slo_tpot=60)
    time.sleep(1.2)  # the scheduler refreshes its series twice a second
    after = server_for_bench.scrape()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(j.output_len for j in jobs)
    assert grew("turnstile:generation_tokens_total") == summary["output_tokens"]
    assert grew("turnstile:prompt_tokens_total") == summary["prompt_tokens"]
    assert grew('turnstile:request_success_total{finished_reason="length"}') == 12
    assert summary["goodput"] == summary["request_throughput"]
    assert after["turnstile:kv_cache_free_blocks"] == after["turnstile:kv_cache_total_blocks"]


@pytest.fixture(scope="module", params=["continuous", "padded"])
def server_for_bench(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server of its own, so that no other test's traffic mixes into the counters; also
    with padded static batching, whose padding tokens must count nowhere."""
    static = [] if request.param == "continuous" else ["--static-batching", request.param]
    with launched_server("--num-blocks", "256", "--max-num-seqs", "8", *static) as running:
        yield running


def test_a_static_batch_waits_to_fill_and_opens_when_its_window_closes() -> None:
    """Requests reaching a static server a little apart still share one batch, and a batch
    that cannot fill opens once its first request has waited the fill timeout."""
    from turnstile.bench import serve_bench

    static = ["--static-batching", "padded", "--static-fill-timeout", "3"]
    with launched_server("--num-blocks", "64", "--max-num-seqs", "3", *static) as server:
        before = server.scrape()["turnstile:executor_step_seconds_count"]
        # Four 6-token answers arriving about 0.25 s apart: three fill a batch, the fourth
        # waits for it to end, then for its window, and runs alone.
        jobs = serve_bench.make_jobs("random", 4, 8, 6, seed=5)
        outcomes, _ = serve_bench.run_load(server.url, MODEL, jobs, 4.0, None, 0, progress=False)
        steps = server.scrape()["turnstile:executor_step_seconds_count"] - before
    assert all(outcome.ok and outcome.output_tokens == 6 for outcome in outcomes)
    assert steps == 2 * 6  # one prefill step and five decodes per batch
