"""The device backends by name; each is imported only when chosen (Triton, for one, is heavy)."""

from __future__ import annotations

from collections.abc import Callable

from turnstile.executor_svc.backend import Backend
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.shared.model_info import ModelInfo


def _cpu() -> type[Backend]:
    from turnstile.executor_svc.backends.cpu import CpuNativeBackend

    return CpuNativeBackend


def _torch() -> type[Backend]:
    from turnstile.executor_svc.backends.torch_reference import TorchReferenceBackend

    return TorchReferenceBackend


def _cuda() -> type[Backend]:
    from turnstile.executor_svc.backends.cuda import CudaBackend

    return CudaBackend


BACKENDS: dict[str, Callable[[], type[Backend]]] = {"cpu": _cpu, "torch": _torch, "cuda": _cuda}


def backend_name(config: RunnerConfig) -> str:
    """The backend `config` asks for; "auto": CUDA on a GPU, on a CPU the native kernels
    where they run (float32 or bfloat16 weights), else the torch reference."""
    if config.executor.backend != "auto":
        if config.executor.backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {config.executor.backend!r}; choose from {sorted(BACKENDS)}"
            )
        return config.executor.backend
    if config.executor.device.startswith("cuda"):
        return "cuda"
    from turnstile.executor_svc.backends.cpu import CpuNativeBackend

    return "cpu" if CpuNativeBackend.runs(config) else "torch"


def create_backend(config: RunnerConfig, info: ModelInfo) -> Backend:
    return BACKENDS[backend_name(config)]()(config, info)
