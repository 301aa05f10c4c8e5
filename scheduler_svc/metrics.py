"""The scheduler's Prometheus series, named after vLLM's under our prefix, and vLLM's periodic
stats line (`stats_log.py`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from turnstile.scheduler_svc.request import Status
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.scheduler_svc.stats_log import StatsLog
from turnstile.shared.config import MetricsConfig


def _gauge(name: str, documentation: str) -> Gauge:
    # Under `turnstile serve` the gateway's /metrics shows the latest value any scheduler
    # process (a restarted one, say) set.
    return Gauge(name, documentation, multiprocess_mode="mostrecent")


_STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.05, 0.25)
_EXECUTOR_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerMetrics:
    def __init__(self, config: MetricsConfig) -> None:
        self.stats_log = None if config.disable_log_stats else StatsLog(config.log_stats_interval)
        self.running = _gauge("turnstile:num_requests_running", "Requests in the running batch")
        self.waiting = _gauge("turnstile:num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = _gauge("turnstile:kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.kv_free = _gauge("turnstile:kv_cache_free_blocks", "KV blocks free")
        self.kv_total = _gauge("turnstile:kv_cache_total_blocks", "KV blocks in all")
        self.prefix_queries = Counter("turnstile:prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = Counter("turnstile:prefix_cache_hits", "Prompt tokens found cached")
        self.preemptions = Counter("turnstile:num_preemptions", "Requests preempted")
        self.prompt_tokens = Counter("turnstile:prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = Counter("turnstile:generation_tokens", "Tokens generated")
        self.spec_drafts = Counter(
            "turnstile:spec_decode_num_drafts", "Rows' steps that verified drafted tokens"
        )
        self.spec_draft_tokens = Counter(
            "turnstile:spec_decode_num_draft_tokens", "Drafted tokens verified"
        )
        self.spec_accepted_tokens = Counter(
            "turnstile:spec_decode_num_accepted_tokens", "Drafted tokens that stood"
        )
        self.finished = Counter(
            "turnstile:request_success", "Requests that ended", ["finished_reason"]
        )
        self.step_seconds = Histogram(
            "turnstile:scheduler_step_seconds",
            "Scheduler CPU time per step (schedule + update)",
            buckets=_STEP_BUCKETS,
        )
        self.executor_seconds = Histogram(
            "turnstile:executor_step_seconds",
            "Time from a plan's start (sent, or the previous result back) to its result",
            buckets=_EXECUTOR_BUCKETS,
        )
        self.plans_in_flight = _gauge(
            "turnstile:scheduler_plans_in_flight",
            "Plans sent and not answered (2: the next one waits at the executor)",
        )
        self.plan_bytes = Histogram(
            "turnstile:plan_bytes",
            "Encoded batch plan size",
            buckets=(16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536),
        )
        # vLLM's: the adapters of the running and waiting requests, as labels of a series whose
        # value is when they were seen (a LoRA-aware router reads the latest).
        self.lora_info = Gauge(
            "turnstile:lora_requests_info", "LoRA adapters of the running and waiting requests",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self._seen = (0,) * 8

    def observe(self, scheduler: Scheduler, max_loras: int = 0) -> None:
        """Every series from the scheduler's state; `max_loras`: the executors' (0: no LoRA)."""
        if max_loras:
            self._observe_adapters(scheduler, max_loras)
        stats = scheduler.stats
        pool = scheduler.pool
        self.running.set(len(scheduler.batch))
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(pool.num_used / pool.num_blocks)
        self.kv_free.set(pool.num_free)
        self.kv_total.set(pool.num_blocks)
        now = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
            stats.prompt_tokens,
            stats.generation_tokens,
            stats.spec_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
        )
        counters = (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
        )
        for counter, value, seen in zip(counters, now, self._seen, strict=True):
            if value > seen:
                counter.inc(value - seen)
        self._seen = now
        if self.stats_log is not None:
            self.stats_log.maybe_log(scheduler)

    def _observe_adapters(self, scheduler: Scheduler, max_loras: int) -> None:
        names: dict[Status, set[str]] = {Status.RUNNING: set(), Status.WAITING: set()}
        for req in scheduler.lifecycle.requests.values():
            if req.lora is not None and req.status in names:
                names[req.status].add(req.lora.name)
        running, waiting = (",".join(sorted(names[s])) for s in (Status.RUNNING, Status.WAITING))
        self.lora_info.labels(str(max_loras), waiting, running).set_to_current_time()
