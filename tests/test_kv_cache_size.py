"""The KV cache's size from vLLM's flags (`executor_svc/kv_cache_size.py`): bytes given, vLLM-CPU's
variable, or a share of the device's memory less what the loaded model holds; on a real stack,
the blocks the scheduler counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import MODEL

from turnstile.executor_svc.kv_cache_size import CPU_SPACE, GIB, device_memory, kv_cache_bytes
from turnstile.executor_svc.runner_config import ExecutorConfig, RunnerConfig
from turnstile.shared.settings import build

CPU = torch.device("cpu")


def test_bytes_given_beat_vllm_cpus_variable_which_beats_a_share_and_the_default() -> None:
    given = build(ExecutorConfig, kv_cache_memory_bytes="123456789", gpu_memory_utilization=0.5)
    assert kv_cache_bytes(given, CPU, 1, {CPU_SPACE: "3"}) == 123_456_789
    share = build(ExecutorConfig, gpu_memory_utilization=0.5)
    assert kv_cache_bytes(share, CPU, 1, {CPU_SPACE: "3"}) == 3 * GIB
    default = build(ExecutorConfig, kv_cache_gib=0.25)
    assert kv_cache_bytes(default, CPU, 1, {CPU_SPACE: "0"}) == GIB // 4  # 0: not given
    with pytest.raises(ValueError, match=f"\\${CPU_SPACE}: '4G' is not a whole number of GiB"):
        kv_cache_bytes(default, CPU, 1, {CPU_SPACE: "4G"})


@pytest.mark.parametrize(
    ("text", "count"), [("4G", 4 * GIB), ("4g", 4 * 10**9), ("25.6k", 25_600), ("1.5K", 1536)]
)
def test_bytes_take_vllms_suffixes(text: str, count: int) -> None:
    assert build(ExecutorConfig, kv_cache_memory_bytes=text).kv_cache_bytes() == count


def test_a_share_of_a_cpus_memory_is_split_among_its_ranks_less_what_the_process_holds() -> None:
    total, held = device_memory(CPU)
    # room beside what this process holds for either count of ranks (it holds the models of
    # the tests before: more than 2 GiB in a whole run)
    fraction = min(1.0, (2 * held + 2 * GIB) / total)
    config = build(ExecutorConfig, gpu_memory_utilization=fraction)
    for ranks in (1, 2):
        got = kv_cache_bytes(config, CPU, ranks, {})
        expected = fraction * total / ranks - device_memory(CPU)[1]
        assert abs(got - expected) < 64 * 2**20  # what this process allocated in between
    too_little = build(ExecutorConfig, gpu_memory_utilization=held / total / 2)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization .* none left for the KV"):
        kv_cache_bytes(too_little, CPU, 1, {})


def test_a_gpus_share_counts_every_process_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the driver's answer is made up (free 60 GiB of 80), the rest is the code's."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))
    config = build(ExecutorConfig, gpu_memory_utilization=0.5)
    assert kv_cache_bytes(config, torch.device("cuda", 0), 4, {CPU_SPACE: "3"}) == 20 * GIB


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [(["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
     (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
     (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes must be positive, got '0'"),
     (["--kv-cache-memory-bytes", "4GB"], "--kv-cache-memory-bytes: '4GB' is not a count")],
)  # fmt: skip
def test_a_value_out_of_range_is_refused_before_anything_starts(
    flags: list[str], refusal: str
) -> None:
    done = subprocess.run([sys.executable, "-m", "turnstile.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and refusal in done.stderr, done.stderr


@pytest.mark.slow  # loads the model
def test_the_executor_holds_about_its_share_once_its_cache_is_sized() -> None:
    """The cache's pages are touched only as blocks are used, so: what the share leaves beside
    the process's memory at sizing, which lies between what it held before and after."""
    from turnstile.executor_svc.cpu_runtime import return_loading_memory
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig

    return_loading_memory()  # what earlier tests freed is not counted as held, as at sizing
    total, before = device_memory(CPU)
    fraction = (before + 2 * GIB) / total
    engine = OfflineEngine(build(RunnerConfig, gpu_memory_utilization=fraction),
                           SchedulingConfig())  # fmt: skip
    after = device_memory(CPU)[1]
    cache = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
    block = cache // engine.runner.num_blocks
    assert fraction * total - after - block <= cache <= fraction * total - before
    assert cache > GIB // 2  # the model left most of the two GiB


@pytest.mark.slow  # starts a stack
def test_a_stack_counts_the_blocks_its_bytes_hold() -> None:
    from turnstile.bench.server_process import launched_server

    with launched_server("--kv-cache-memory-bytes", "100000000") as server:
        blocks = server.scrape()["turnstile:kv_cache_total_blocks"]
    # the embedded model's bf16 cache: K and V, 30 layers, blocks of 16, 3 KV heads of 64
    assert blocks == 100_000_000 // (2 * 30 * 16 * 3 * 64 * 2)


def test_a_share_that_leaves_no_cache_stops_the_stack_naming_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", "--gpu-memory-utilization", "0.001"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "--gpu-memory-utilization 0.001" in done.stderr, MODEL
    # A refusal is final: the executor is not started again to refuse again (shared.REFUSED).
    assert done.stderr.count("none left for the KV cache") == 1
    assert "executor refused its settings; stopping" in done.stderr
