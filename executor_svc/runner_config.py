"""What one executor runs: the engine's model and shape, its device and backend, its KV cache."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from turnstile.shared.config import AddressConfig, EngineConfig, MetricsConfig
from turnstile.shared.lora import LoraConfig
from turnstile.shared.settings import nested, setting


@dataclass(slots=True, frozen=True)
class ExecutorConfig:
    """The executor's device, backend and KV cache"""

    device: Literal["cpu", "cuda"] = setting("cpu", "where the model runs")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = setting(
        "auto", "the weights' (auto: the backend's best)"
    )
    backend: Literal["auto", "cpu", "torch", "cuda"] = setting(
        "auto",
        "auto: cuda on a GPU; on a CPU the native kernels where they run, else torch (the "
        "plain-torch reference)",
    )
    quantization: Literal["auto", "gguf", "gptq", "awq", "compressed-tensors", "none"] = setting(
        "auto",
        "gguf: compute on a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks as stored, activations "
        "quantized to int8 (cpu backend; on AMX-INT8, see --cpu-products); gptq, awq, "
        "compressed-tensors: a GPTQ, AWQ or compressed-tensors checkpoint's int matrices alike; "
        "none: dequantize every weight to --dtype; auto: kept quantized for a GGUF file or such "
        "a checkpoint on the cpu backend when no --dtype is given, else dequantized",
    )
    kv_cache_dtype: Literal[
        "auto", "bfloat16", "float32", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"
    ] = setting(
        "auto",
        "the KV cache's (auto: the activations'; bfloat16 where GGUF blocks stay quantized: "
        "half the bytes a decode step's attention reads); fp8 (= fp8_e4m3), fp8_e5m2: a byte a "
        "value, no scale (1.0, vLLM's default), values beyond the format's largest saturate to "
        "it (cpu and torch backends)",
    )
    cpu_attention: Literal["auto", "tiles", "rows"] = setting(
        "auto",
        "cpu backend, bfloat16 or fp8 KV cache: tiles: AMX-BF16 tiles (bf16 queries and softmax "
        "weights, fp32 sums); rows: float32 rows; auto: tiles where the CPU has AMX-BF16",
    )
    cpu_products: Literal["auto", "tiles", "blocks"] = setting(
        "auto",
        "cpu backend, --quantization gguf: tiles: weights requantized at load to int8 with a "
        "scale a feature, activations to 16 bits a row, on AMX-INT8 tiles; blocks: the GGUF "
        "blocks as stored, activations int8 per block of 32; auto: tiles where the CPU has "
        "AMX-INT8",
    )
    cpu_bf16_products: Literal["auto", "tiles", "rows"] = setting(
        "auto",
        "cpu backend, bfloat16 weights: tiles: products and a mixture's experts on AMX-BF16 "
        "tiles (activations rounded to bf16, fp32 sums); rows: float32 arithmetic on the bf16 "
        "weights (experts: torch's grouped matmuls); auto: tiles where the CPU has AMX-BF16",
    )
    enforce_eager: bool = setting(False, "cuda: run decode steps eagerly, not as CUDA graphs")
    seed: int | None = setting(
        None,
        "where requests without a seed draw from: the same draws for the same requests in "
        "the same order (vLLM's flag); none: fresh at each start",
    )
    kv_cache_gib: float = setting(1.5, "memory for the KV cache")
    gpu_memory_utilization: float | None = setting(
        None,
        "the share of the device's memory this executor may hold (a CPU's: the machine's or "
        "container's, split among the ranks), the KV cache taking what the loaded model leaves "
        "of it (vLLM's flag; vLLM's default, 0.92, is not ours: --kv-cache-gib unless given)",
    )
    kv_cache_memory_bytes: str | None = setting(
        None,
        "memory for the KV cache in bytes, vLLM's suffixes allowed (4G: 4 GiB, 4g: 4e9) (vLLM's "
        "flag; on a CPU, vLLM-CPU's $VLLM_CPU_KVCACHE_SPACE in GiB too); overrides "
        "--gpu-memory-utilization and --kv-cache-gib",
    )
    num_blocks: int | None = setting(None, "KV blocks to allocate (overrides the memory flags)")
    rank: int = setting(0, "this executor's rank among --tensor-parallel-size ranks")
    distributed_init_method: str = setting(
        "tcp://127.0.0.1:29517", "where the ranks meet to form their group (torch.distributed)"
    )
    distributed_timeout: float = setting(
        60.0, "seconds a collective waits for every rank before it fails (a rank that died)"
    )

    def __post_init__(self) -> None:
        fraction = self.gpu_memory_utilization
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
        self.kv_cache_bytes()  # refused now, not once the model is loaded

    def kv_cache_bytes(self) -> int | None:
        """`--kv-cache-memory-bytes` as a count, read as vLLM reads it: a whole number, or one
        with a suffix, decimal (k, m, g, t) or binary (K, M, G, T)."""
        text = self.kv_cache_memory_bytes
        if text is None:
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
        if match is None:
            raise ValueError(f"--kv-cache-memory-bytes: {text!r} is not a count of bytes")
        number, suffix = match.groups()
        power = "kmgt".find(suffix.lower()) + 1 if suffix else 0
        count = int(float(number) * ((1000 if suffix.islower() else 1024) ** power))
        if count <= 0:
            raise ValueError(f"--kv-cache-memory-bytes must be positive, got {text!r}")
        return count


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    engine: EngineConfig = nested(EngineConfig)
    executor: ExecutorConfig = nested(ExecutorConfig)
    lora: LoraConfig = nested(LoraConfig)

    @property
    def model_path(self) -> Path:
        return self.engine.model_path


@dataclass(slots=True, frozen=True)
class ExecutorServiceConfig:
    runner: RunnerConfig = nested(RunnerConfig)
    addresses: AddressConfig = nested(AddressConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
