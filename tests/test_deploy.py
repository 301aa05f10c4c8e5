"""What can be checked of the compose stack without a Docker engine: the files parse, every
service runs a real `turnstile` sub-command with flags it accepts, and ports agree with the
Prometheus scrape targets and the Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from turnstile.cli import build_parser, settings_of

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def settings(service: str) -> object:
    """What the compose service runs with: its command's flags, then the stack's variables."""
    stack = compose()
    args = build_parser().parse_args(stack["services"][service]["command"])
    # As compose expands them with the variables unset: ${NAME:-default} is the default.
    environ = {
        name: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
        for name, value in stack["x-turnstile"]["environment"].items()
    }
    return settings_of(args, environ | {"TURNSTILE_CURVE_SECRET_KEY": "k"})


def test_every_turnstile_service_runs_a_real_subcommand_with_valid_flags() -> None:
    services = compose()["services"]
    turnstile = {
        name: s for name, s in services.items() if s.get("image", "").startswith("turnstile:")
    }
    assert {"scheduler", "executor", "executor-cuda", "gateway"} <= set(turnstile)
    for name, service in turnstile.items():
        assert service["command"][0] in ("scheduler", "executor", "gateway"), name
        settings(name)  # flags and variables all bind
    cuda = services["executor-cuda"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert cuda["driver"] == "nvidia" and "gpu" in cuda["capabilities"]


def test_the_cuda_profile_builds_torch_from_a_cuda_wheel_index() -> None:
    """The Dockerfile's torch comes from TORCH_INDEX (the CPU wheels by default); the cuda
    profile's image passes a CUDA one, under a tag of its own."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "--index-url ${TORCH_INDEX}" in dockerfile
    cuda = compose()["services"]["executor-cuda"]
    index = cuda["build"]["args"]["TORCH_INDEX"]
    assert "download.pytorch.org/whl/cu" in index and cuda["image"] != "turnstile:latest"
    executor = settings("executor-cuda").runner.executor
    assert executor.device == "cuda" and executor.backend == "auto"


def test_scrape_targets_match_the_ports_services_serve_metrics_on() -> None:
    services = compose()["services"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape["scrape_configs"]
    }
    assert set(targets) == {"gateway", "scheduler", "executor"}
    for job, target in targets.items():
        host, port = target.split(":")
        config = settings(job)
        served = config.gateway.port if job == "gateway" else config.metrics.metrics_port
        assert (host, int(port)) == (job, served)
        assert port in [str(p) for p in services[job].get("expose", [])] + [
            p.split(":")[-1] for p in services[job].get("ports", [])
        ]


def test_zmq_addresses_agree_between_services() -> None:
    env = compose()["x-turnstile"]["environment"]
    bound = settings("scheduler").addresses
    executor, gateway = settings("executor").addresses, settings("gateway").addresses
    for where, used in (
        (bound.scheduler_address, gateway.scheduler_address),
        (bound.executors_address, executor.executors_address),
    ):
        assert where.rsplit(":", 1)[1] == used.rsplit(":", 1)[1]
        assert where.startswith("tcp://0.0.0.0:") and used.startswith("tcp://scheduler:")
    # TCP between containers: every link encrypted, and closed to peers without the key.
    assert "TURNSTILE_CURVE_SECRET_KEY" in env


def test_dashboard_queries_only_series_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/turnstile.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for series in (
        "turnstile:generation_tokens_total", "turnstile:time_to_first_token_seconds_bucket",
        "turnstile:inter_token_latency_seconds_bucket", "turnstile:num_requests_running",
        "turnstile:num_requests_waiting", "turnstile:kv_cache_usage_perc",
        "turnstile:prefix_cache_hits_total", "turnstile:num_preemptions_total",
        "turnstile:scheduler_step_seconds_bucket", "turnstile:executor_step_seconds_bucket",
        "turnstile:plan_bytes_bucket", "turnstile:executor_idle_seconds_sum",
        "turnstile:scheduler_plans_in_flight", "turnstile:spec_decode_num_accepted_tokens_total",
    ):  # fmt: skip
        assert series in exprs


def test_the_tp2_profile_adds_a_second_rank_that_meets_the_first() -> None:
    first, second = settings("executor").runner, settings("executor-rank1").runner
    assert (first.executor.rank, second.executor.rank) == (0, 1)
    meet = first.executor.distributed_init_method
    assert meet == second.executor.distributed_init_method == "tcp://executor:29517"
    assert compose()["services"]["executor"]["hostname"] == "executor"
    assert "29517" in compose()["services"]["executor"]["expose"]
