"""How much memory the KV cache gets, as vLLM's flags say: `--kv-cache-memory-bytes` (on a CPU,
vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE` in GiB too); else `--gpu-memory-utilization`, the share of
the device's memory this executor may hold, less what it holds once the model is loaded (its
weights, the runtime); else `--kv-cache-gib`. `--num-blocks` overrides them all."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from turnstile.executor_svc.cpu_runtime import return_loading_memory
from turnstile.executor_svc.runner_config import ExecutorConfig

GIB = 2**30
CPU_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # vLLM-CPU's variable, in GiB; unset or 0: not given


def kv_cache_bytes(
    executor: ExecutorConfig, device: torch.device, ranks: int,
    environ: Mapping[str, str] = os.environ,
) -> int:  # fmt: skip
    """The KV cache's bytes on this rank of `ranks` (a CPU's ranks share its memory)."""
    given = executor.kv_cache_bytes()
    if given is not None:
        return given
    space = environ.get(CPU_SPACE, "").strip()
    if device.type == "cpu" and space not in ("", "0"):
        if not space.isdigit():
            raise ValueError(f"${CPU_SPACE}: {space!r} is not a whole number of GiB")
        return int(space) * GIB
    fraction = executor.gpu_memory_utilization
    if fraction is None:
        return int(executor.kv_cache_gib * GIB)
    if device.type == "cpu":
        return_loading_memory()  # what loading freed is not held
    total, held = device_memory(device)
    share = fraction * total / (ranks if device.type == "cpu" else 1)
    if share <= held:
        raise ValueError(
            f"--gpu-memory-utilization {fraction}: {share / GIB:.2f} GiB of the {device.type}'s "
            f"{total / GIB:.2f} GiB for this executor, which already holds {held / GIB:.2f} GiB "
            "(the model and its runtime): none left for the KV cache"
        )
    return int(share - held)


def device_memory(device: torch.device) -> tuple[int, int]:
    """The device's memory and what is in use: on CUDA, by every process (what the driver
    says is not free); on a CPU, the machine's or the container's limit, and this process's
    resident memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    total = _meminfo_total()
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(limit)
        if text.isdigit():  # "max" where the container has no limit
            total = min(total, int(text))
    resident_pages = int(_read("/proc/self/statm").split()[1])
    return total, resident_pages * os.sysconf("SC_PAGE_SIZE")


def _meminfo_total() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
