"""`turnstile bench scheduler`: the scheduler's cost per step with a simulated executor.

Timed per step: `schedule()` plus encoding the plan, and decoding the step result plus
`update()` — everything the scheduler process does; the executor's time is left out.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from turnstile.executor_svc.simulated_executor import SimulatedExecutor
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.config import DEFAULT_BATCHED_TOKENS, EngineConfig, SchedulerConfig
from turnstile.shared.protocol import AddRequest, BatchPlan, SamplingParams, StepResult, pack_ids
from turnstile.shared.settings import build

VOCAB = 49152
EOS = 2


@dataclass(slots=True)
class Workload:
    name: str
    running: int
    prompt_len: int
    shared_prefixes: int  # 0: every prompt distinct; k: prompts start with one of k long prefixes
    mean_output: int  # 0: never ends (steady decode)


@dataclass(slots=True)
class Measurement:
    workload: str
    us_per_step: float
    plan_bytes: float
    preemptions: int
    prefix_hit_rate: float


WORKLOADS = [
    Workload("decode 64", 64, 128, 0, 0),
    Workload("decode 256", 256, 128, 0, 0),
    Workload("decode 1024", 1024, 128, 0, 0),
    Workload("mixed 256 (prefill+decode, prefix hits)", 256, 640, 4, 96),
]


class _Driver:
    def __init__(self, load: Workload, seed: int) -> None:
        self.load = load
        self.rng = np.random.default_rng(seed)
        max_len = 8192
        block_size = EngineConfig().block_size
        config = build(
            SchedulerConfig,
            num_blocks=load.running * (max_len // block_size) // 4,
            block_size=block_size,
            max_num_seqs=load.running,
            max_num_batched_tokens=max(DEFAULT_BATCHED_TOKENS, load.running),
            max_model_len=max_len,
        )
        self.scheduler = Scheduler(config, eos_token_ids=(EOS,), vocab_size=VOCAB)
        self.lengths: dict[int, int] = {}
        self.executor = SimulatedExecutor(
            load.running, max_len, config.block_size, VOCAB, EOS, self._output_len
        )
        self.prefixes = [self.rng.integers(3, VOCAB, 512) for _ in range(load.shared_prefixes)]
        self.next_id = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.plan_decoder = msgspec.msgpack.Decoder(BatchPlan)
        self.result_decoder = msgspec.msgpack.Decoder(StepResult)

    def _output_len(self, seed: int) -> int:
        return self.lengths[seed]

    def add(self) -> None:
        load = self.load
        if load.shared_prefixes:
            prefix = self.prefixes[self.next_id % load.shared_prefixes]
            tail = self.rng.integers(3, VOCAB, load.prompt_len - len(prefix))
            prompt = np.concatenate([prefix, tail])
        else:
            prompt = self.rng.integers(3, VOCAB, load.prompt_len)
        steady = load.mean_output == 0
        length = 10**6 if steady else int(self.rng.geometric(1 / load.mean_output))
        self.lengths[self.next_id] = length
        self.scheduler.add_request(
            AddRequest(
                req_id=self.next_id,
                prompt_ids=pack_ids(prompt),
                max_tokens=length,
                sampling=SamplingParams(seed=self.next_id),
                ignore_eos=steady,
            )
        )
        self.next_id += 1

    def step(self) -> tuple[int, int]:
        """One step; returns (scheduler nanoseconds, plan bytes)."""
        started = time.perf_counter_ns()
        wire = self.encoder.encode(self.scheduler.schedule())
        middle = time.perf_counter_ns()
        result = self.encoder.encode(self.executor.execute(self.plan_decoder.decode(wire)))
        resumed = time.perf_counter_ns()
        self.scheduler.update(self.result_decoder.decode(result))
        ended = time.perf_counter_ns()
        return (middle - started) + (ended - resumed), len(wire)


def measure(load: Workload, steps: int, seed: int) -> Measurement:
    driver = _Driver(load, seed)
    for _ in range(load.running):
        driver.add()
    while (
        len(driver.scheduler.waiting)
        or driver.scheduler.batch.num_computed[driver.scheduler.batch.order].min() < load.prompt_len
    ):
        driver.step()
    times, sizes = [], []
    for _ in range(steps):
        while len(driver.scheduler.requests) < load.running:
            driver.add()
        elapsed, size = driver.step()
        times.append(elapsed)
        sizes.append(size)
    stats = driver.scheduler.stats
    return Measurement(
        workload=load.name,
        us_per_step=statistics.median(times) / 1000,
        plan_bytes=statistics.mean(sizes),
        preemptions=stats.num_preemptions,
        prefix_hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
    )


def run(steps: int = 300, repeats: int = 5) -> list[Measurement]:
    results = []
    for load in WORKLOADS:
        runs = [measure(load, steps, seed) for seed in range(repeats)]
        results.append(
            Measurement(
                workload=load.name,
                us_per_step=statistics.median(r.us_per_step for r in runs),
                plan_bytes=statistics.median(r.plan_bytes for r in runs),
                preemptions=sum(r.preemptions for r in runs),
                prefix_hit_rate=statistics.median(r.prefix_hit_rate for r in runs),
            )
        )
    return results


def format_table(results: list[Measurement]) -> str:
    lines = [
        "| workload | median µs/step | mean plan bytes/step | prefix hit rate |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.workload} | {r.us_per_step:.1f} | {r.plan_bytes:.1f} | {r.prefix_hit_rate:.0%} |"
        for r in results
    ]
    return "\n".join(lines)
