"""`turnstile bench step`: where a decode step's time goes, by kind of work.

R requests of L prompt tokens run together on the offline engine (the service's scheduler and
model runner, no sockets). Once every row decodes, S steps are timed by the wall clock and the
next S are profiled with torch.profiler, each op's self time summed into a kind of work. The
profiler slows small ops, so its split is read as shares, and the wall clock as the total.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from turnstile.executor_svc.backends import native_decode
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native
from turnstile.offline import OfflineEngine
from turnstile.shared.config import DEFAULT_BATCHED_TOKENS, SchedulingConfig
from turnstile.shared.protocol import AddRequest, pack_ids
from turnstile.shared.settings import build

# Op names (torch 2.13, CPU) and native kernels' labels by the part of the model that calls them.
KINDS = {
    "decode layers (native, one call a layer)": (native_decode.PROFILE_LABEL,),
    "projections": (cpu_native.PROFILE_LABEL, "aten::addmm", "aten::mm", "aten::linear"),
    "attention": (
        "aten::index_select",
        "aten::index_copy_",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::scaled_dot_product_attention",
    ),
    "norms": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::pow", "aten::mean", "aten::rsqrt"),
}


@dataclass(slots=True)
class StepProfile:
    rows: int
    context: int
    wall_ms: float  # median unprofiled step
    profiled_ms: float  # mean profiled step
    ms_by_kind: dict[str, float]  # mean self time per profiled step

    def lines(self) -> list[str]:
        outside = self.profiled_ms - sum(self.ms_by_kind.values())
        parts = [*self.ms_by_kind.items(), ("outside torch ops (Python, scheduler)", outside)]
        return [
            f"{self.rows} rows decoding at context ~{self.context}: "
            f"{self.wall_ms:.1f} ms a step (median, unprofiled)",
            f"profiled {self.profiled_ms:.1f} ms a step: "
            + ", ".join(f"{kind} {ms:.1f} ms ({ms / self.profiled_ms:.0%})" for kind, ms in parts),
        ]


def run(
    rows: int,
    prompt_len: int,
    steps: int,
    dtype: str,
    products: str = "auto",
    kv_cache_dtype: str = "auto",
) -> StepProfile:
    engine = OfflineEngine(
        build(
            RunnerConfig,
            dtype=dtype,
            max_num_seqs=rows,
            cpu_products=products,
            kv_cache_dtype=kv_cache_dtype,
        ),
        SchedulingConfig(max(DEFAULT_BATCHED_TOKENS, rows * prompt_len)),
    )
    scheduler, runner = engine.scheduler, engine.runner
    rng = np.random.default_rng(0)
    for i in range(rows):
        prompt = pack_ids(rng.integers(100, 40000, prompt_len).tolist())
        request = AddRequest(req_id=i, prompt_ids=prompt, max_tokens=2 * steps + 2, ignore_eos=True)
        scheduler.add_request(request)

    def step() -> None:
        scheduler.update(runner.execute(scheduler.schedule()))

    step()  # every prompt in one step: from here on, every row decodes
    wall = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        wall.append(time.perf_counter() - started)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        profiled = (time.perf_counter() - started) / steps
    self_ms = {e.key: e.self_cpu_time_total / 1000 / steps for e in profile.key_averages()}
    by_kind = {kind: sum(self_ms.get(op, 0.0) for op in ops) for kind, ops in KINDS.items()}
    known = {op for ops in KINDS.values() for op in ops}
    by_kind["other torch ops"] = sum(ms for op, ms in self_ms.items() if op not in known)
    return StepProfile(
        rows=rows,
        context=prompt_len + steps,
        wall_ms=statistics.median(wall) * 1000,
        profiled_ms=profiled * 1000,
        ms_by_kind=by_kind,
    )
