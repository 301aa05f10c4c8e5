"""`turnstile bench overlap`: what async scheduling hides, lockstep and async alternated.

- simulated: the real scheduler process against an executor process whose every step takes a
  fixed time (a GPU-like step, no model), `running` requests decoding at once: steps per
  second, against the ideal 1 / step time;
- served: the real stack on the embedded model, the `random` dataset all at once: output
  throughput, and the executor's idle share of the run's wall time (its
  `turnstile:executor_idle_seconds_sum` over the run).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import zmq

from turnstile.bench.serve_bench import make_jobs, run_load, summarize
from turnstile.bench.server_process import launched_server
from turnstile.executor_svc.runner_config import ExecutorServiceConfig, RunnerConfig
from turnstile.executor_svc.service import serve_plans
from turnstile.executor_svc.simulated_executor import SimulatedExecutor
from turnstile.launcher import Service, run_service
from turnstile.scheduler_svc.service_config import SchedulerServiceConfig
from turnstile.shared.config import AddressConfig, EngineConfig, SchedulingConfig
from turnstile.shared.model_info import ModelInfo, embedded_model_path, read_model_info, served_name
from turnstile.shared.protocol import (
    AddRequest,
    BatchPlan,
    EngineOutputs,
    FromScheduler,
    Heartbeat,
    SchedulerStatus,
    StepResult,
    pack_ids,
)
from turnstile.shared.zmq_io import FrameCodec, make_socket

MODES = {"lockstep": False, "async": True}
PROMPT_LEN = 32
SPIN_SECONDS = 3e-4


class FixedTimeRunner:
    """Plans applied as a real executor applies them, scripted tokens, and a device that takes
    a fixed time a step: a step starts once launched and the step before it has ended, and its
    tokens are there when it ends (as a GPU's stream runs launched work in order)."""

    def __init__(self, engine: EngineConfig, info: ModelInfo, step_seconds: float) -> None:
        self.info, self.engine, self.step_seconds = info, engine, step_seconds
        self.max_model_len = info.max_model_len
        self.num_blocks = engine.max_num_seqs * (self.max_model_len // engine.block_size)
        self.load_seconds = 0.0
        self.max_loras = 0  # scripted tokens: no adapter
        self.reset(1)

    def reset(self, first_step: int) -> None:
        engine, info = self.engine, self.info
        self.executor = SimulatedExecutor(
            engine.max_num_seqs, self.max_model_len, engine.block_size, info.vocab_size,
            info.eos_token_id, lambda _: 10**9,
        )  # fmt: skip
        self.executor.applier.step = first_step - 1
        self.free_at = 0.0  # when the device ends the last step launched

    def launch(self, plan: BatchPlan) -> TimedStep:
        self.free_at = max(time.perf_counter(), self.free_at) + self.step_seconds
        return TimedStep(plan.step, self.executor.execute(plan), self.free_at)


class TimedStep:
    """A step on the simulated device: its answer is known at launch, and given at its end."""

    def __init__(self, step: int, answer: StepResult, ends_at: float) -> None:
        self.step, self.answer, self.ends_at = step, answer, ends_at

    def done(self) -> bool:
        return time.perf_counter() >= self.ends_at

    def wait(self) -> None:
        # A sleep overshoots by ~0.1 ms here: sleep most of the way, spin the rest.
        if (left := self.ends_at - time.perf_counter()) > SPIN_SECONDS:
            time.sleep(left - SPIN_SECONDS)
        while time.perf_counter() < self.ends_at:
            pass

    def result(self) -> StepResult:
        self.wait()
        return self.answer


def _fixed_time_executor(config: ExecutorServiceConfig, step_seconds: float) -> None:
    info = read_model_info(config.runner.model_path)
    serve_plans(config, FixedTimeRunner(config.runner.engine, info, step_seconds))


def _steps_per_second(gateway_address: str, running: int, window: float) -> float:
    """Send `running` long requests, wait until all decode, then count the steps answered."""
    socket = make_socket(zmq.Context.instance(), zmq.DEALER, gateway_address, bind=False)
    codec: FrameCodec[FromScheduler] = FrameCodec(FromScheduler, "bench.gateway")
    socket.send(codec.encode(Heartbeat(0)))
    rng = np.random.default_rng(0)
    sent = False
    started = counted = 0.0
    steps = 0
    while True:
        message = codec.decode(socket.recv())
        if isinstance(message, SchedulerStatus) and message.ready and not sent:
            for req_id in range(1, running + 1):
                prompt = pack_ids(rng.integers(100, 40000, PROMPT_LEN))
                request = AddRequest(req_id, prompt, max_tokens=10**6, ignore_eos=True)
                socket.send(codec.encode(request))
            sent = True
        elif isinstance(message, SchedulerStatus) and message.num_running == running:
            started = started or time.perf_counter() + 0.5  # a warm-up half second
        elif isinstance(message, EngineOutputs) and started and len(message.req_ids):
            now = time.perf_counter()
            if now >= started:
                counted, steps = (counted or now), steps + 1
                if now - counted >= window:
                    socket.close(linger=0)
                    return (steps - 1) / (now - counted)


@contextlib.contextmanager
def simulated_stack(step_seconds: float, running: int, ahead: bool) -> Iterator[str]:
    """The real scheduler process and a fixed-time executor process; yields the scheduler's
    gateway address."""
    spawn = multiprocessing.get_context("spawn")
    engine = EngineConfig(max_num_seqs=running, max_model_len=None)
    with tempfile.TemporaryDirectory() as run_dir:
        addresses = AddressConfig(
            f"ipc://{run_dir}/scheduler.sock", f"ipc://{run_dir}/executors.sock"
        )
        scheduling = SchedulingConfig(
            max_num_batched_tokens=running * PROMPT_LEN, async_scheduling=ahead
        )
        scheduler = SchedulerServiceConfig(engine, addresses, scheduling)
        executor = ExecutorServiceConfig(RunnerConfig(engine), addresses)
        children = [
            spawn.Process(target=run_service, args=(Service("scheduler", scheduler),)),
            spawn.Process(target=_fixed_time_executor, args=(executor, step_seconds)),
        ]
        for child in children:
            child.start()
        try:
            yield addresses.scheduler_address or ""
        finally:
            for child in children:
                child.kill()
                child.join()


def simulated(step_ms: float, running: int, window: float, rounds: int) -> dict[str, object]:
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, ahead in MODES.items():
            with simulated_stack(step_ms / 1000, running, ahead) as address:
                per_mode[mode].append(_steps_per_second(address, running, window))
    ideal = 1000 / step_ms
    return {
        "setup": {"step_ms": step_ms, "running": running, "window_s": window, "rounds": rounds},
        "ideal_steps_per_s": ideal,
        **{
            f"{mode}_steps_per_s": {"median": statistics.median(rates), "runs": rates}
            for mode, rates in per_mode.items()
        },
        **{
            f"{mode}_of_ideal": statistics.median(rates) / ideal for mode, rates in per_mode.items()
        },
    }


def _idle_seconds(metrics: dict[str, float]) -> float:
    return metrics.get("turnstile:executor_idle_seconds_sum", 0.0)


def served(num_prompts: int, input_len: int, output_len: int, rounds: int) -> dict[str, object]:
    jobs = make_jobs("random", num_prompts, input_len, output_len, seed=0)
    model = served_name(embedded_model_path())
    per_mode: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, ahead in MODES.items():
            flags = [] if ahead else ["--no-async-scheduling"]
            with launched_server(*flags) as server:
                run_load(server.url, model, jobs[:2], float("inf"), None, 0, progress=False)
                before = _idle_seconds(server.scrape(server.metrics_port + 1))
                outcomes, duration = run_load(
                    server.url, model, jobs, float("inf"), None, 0, progress=False
                )
                idle = _idle_seconds(server.scrape(server.metrics_port + 1)) - before
            summary = summarize(outcomes, duration, slo_ttft=60, slo_tpot=60)
            throughput = float(summary["output_throughput"])  # type: ignore[arg-type]
            per_mode[mode].append((throughput, idle / duration))
    return {
        "setup": {
            "prompts": num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "rounds": rounds,
        },
        **{
            mode: {
                "output_tok_s": statistics.median(r[0] for r in runs),
                "executor_idle_share": statistics.median(r[1] for r in runs),
                "runs": runs,
            }
            for mode, runs in per_mode.items()
        },
        "async_over_lockstep": [
            ahead[0] / lockstep[0]
            for ahead, lockstep in zip(per_mode["async"], per_mode["lockstep"], strict=True)
        ],
    }
