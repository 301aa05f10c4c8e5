"""`turnstile bench lora`: what a LoRA adapter costs a decode step on the cpu backend, offline
on the embedded model (its defaults: the GGUF file's quantized weights). Each of `rows`
requests has a 32-token prompt and generates 64 tokens, all through a random adapter
(`random_llama.lora`: q, v and down, rank 8) or none; milliseconds per generated token's step,
the median of `repeats` alternating runs. "through the layers": the adapter's steps take the
model's layer code (`Route.LAYERS`, where a step's long prompt chunks send every token), as
every step holding an adapter's rows did before they took the fused layers."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from turnstile.bench import random_llama
from turnstile.executor_svc.backend import Route
from turnstile.executor_svc.backends.cpu import CpuNativeBackend
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.lora import LoraConfig, adapters
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import AddRequest, LoraRef, pack_ids
from turnstile.shared.settings import build

NEW_TOKENS = 64


def measure(rows: list[int], repeats: int) -> dict[int, dict[str, float]]:
    info = read_model_info(embedded_model_path())
    with tempfile.TemporaryDirectory() as folder:
        adapter = random_llama.lora(Path(folder), info)
        modules = [f"a={adapter}"]
        engine = OfflineEngine(
            build(RunnerConfig, num_blocks=1024, max_num_seqs=max(rows), enable_lora=True,
                  lora_modules=modules),
            SchedulingConfig(max_num_batched_tokens=max(2048, 32 * max(rows))),
        )  # fmt: skip
        ref = adapters(LoraConfig(enable_lora=True, lora_modules=modules), info)[0].ref
        fused = engine.runner.backend.route
        backend = engine.runner.backend
        assert isinstance(backend, CpuNativeBackend), "the cpu backend's fused layers"

        def layers(layout):  # type: ignore[no-untyped-def]
            return Route.LAYERS if layout.inputs.lora_segments else fused(layout)

        cases = {"base model": (None, fused), "adapter": (ref, fused),
                 "adapter through the layers": (ref, layers)}  # fmt: skip
        found = {}
        for count in rows:
            times: dict[str, list[float]] = {name: [] for name in cases}
            for run in range(repeats + 1):  # the first a warm-up
                for name, (lora, route) in cases.items():
                    backend.route = route  # type: ignore[method-assign]
                    ms = _step_ms(engine, count, lora)
                    if run:
                        times[name].append(ms)
            backend.route = fused  # type: ignore[method-assign]
            found[count] = {name: statistics.median(ms) for name, ms in times.items()}
        return found


def _step_ms(engine: OfflineEngine, rows: int, lora: LoraRef | None) -> float:
    requests = [
        AddRequest(req_id=i, prompt_ids=pack_ids(list(range(100 + i, 132 + i))),
                   max_tokens=NEW_TOKENS, ignore_eos=True, lora=lora)
        for i in range(rows)
    ]  # fmt: skip
    started = time.perf_counter()
    engine.generate(requests)
    return (time.perf_counter() - started) * 1000 / NEW_TOKENS
