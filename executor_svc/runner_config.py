"""What one executor runs: the model, its device and backend, and the cache's size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    model_path: Path
    dtype: str = "auto"  # the weights'; "auto": the backend's best (`Backend.default_dtype`)
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 256
    kv_cache_gib: float = 1.5
    num_blocks: int | None = None  # overrides kv_cache_gib
    max_model_len: int | None = None  # defaults to the model's context
    backend: str = "auto"  # a name in `executor_svc.backends.BACKENDS`
    enforce_eager: bool = False  # no CUDA graphs (vLLM's flag)
