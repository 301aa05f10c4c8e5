"""`turnstile bench memory`: a model's resident memory once loaded, and at its peak while it
loaded, against its file and KV cache. Each load runs in a fresh process, its resident set
read before and after, so what the interpreter and torch already held is not counted and
nothing an earlier load freed is."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from turnstile.executor_svc.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class Footprint:
    file_bytes: int
    resident_bytes: int  # the process's resident set after the load, less before
    kv_bytes: int
    peak_bytes: int  # its largest anonymous memory while loading (sampled), less before

    @property
    def ratio(self) -> float:
        """Resident memory less the KV cache, per byte of the file."""
        return (self.resident_bytes - self.kv_bytes) / self.file_bytes


def resident_bytes(field: str = "VmRSS") -> int:
    """The process's resident set (RssAnon: its anonymous part)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(
    model: Path, quantization: str = "auto", num_blocks: int = 64, products: str = "auto"
) -> Footprint:
    """The load of `model` as `turnstile serve --quantization ... --cpu-products ...` loads
    it, in a new process."""
    code = "import sys; from turnstile.bench.memory_bench import _load; _load(*sys.argv[1:])"
    argv = [sys.executable, "-c", code, str(model), quantization, str(num_blocks), products]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return Footprint(**json.loads(done.stdout.splitlines()[-1]))


def _load(model: str, quantization: str, num_blocks: str, products: str) -> None:
    from turnstile.executor_svc.model_runner import ModelRunner
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.settings import build

    config = build(RunnerConfig, model=model, quantization=quantization,
                   num_blocks=int(num_blocks), cpu_products=products)  # fmt: skip
    print(json.dumps(asdict(footprint(Path(model), lambda: ModelRunner(config)))))


def footprint(model: Path, load: Callable[[], ModelRunner]) -> Footprint:
    """What `load` adds to this process's resident set, its KV cache made resident as a full
    server's (its pages are lazy); and the most anonymous memory it held meanwhile, sampled
    every 5 ms (the file's mapped pages, which the kernel may drop, not counted)."""
    before, anonymous = resident_bytes(), resident_bytes("RssAnon")
    samples = [anonymous]
    loading = threading.Event()
    loading.set()

    def sample() -> None:
        while loading.is_set():
            samples.append(resident_bytes("RssAnon"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    runner = load()
    loading.clear()
    sampler.join()
    for keys, values in runner.kv_caches:
        keys.zero_()
        values.zero_()
    gc.collect()
    after = resident_bytes()
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    return Footprint(model.stat().st_size, after - before, kv, max(samples) - anonymous)
