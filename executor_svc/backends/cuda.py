"""The CUDA backend: Triton attention (`kernels/triton_attention.py`, as the torch custom ops of
`kernels/triton_ops.py`), cuBLAS projections, bf16 weights and KV cache, sampling on the device,
CUDA graphs for decode steps (`cuda_graphs.py`).

A step's host arrays reach the GPU in one pinned, non-blocking copy (`Staging`); the forward
pass and sampling never wait for the host; one device-to-host copy returns the sampled ids.
It also runs on the CPU under TRITON_INTERPRET=1 and on the `meta` device (the kernels' fake
implementations), which is how a machine without a GPU tests it.
"""

from __future__ import annotations

import torch

from turnstile.executor_svc.backend import Backend, DeviceStep, KVCaches
from turnstile.executor_svc.backends.cuda_graphs import DecodeGraphs, capture_sizes
from turnstile.executor_svc.model.attention import PagedAttention
from turnstile.executor_svc.model.encoder import EncoderModel
from turnstile.executor_svc.model.llama import LlamaModel
from turnstile.executor_svc.model.lora import LoraWeights
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import triton_ops
from turnstile.shared.model_info import ModelInfo

TRITON_ATTENTION = PagedAttention(triton_ops.write_kv, triton_ops.decode, triton_ops.prefill)


class CudaBackend(Backend):
    name = "cuda"
    attention = TRITON_ATTENTION

    def __init__(self, config: RunnerConfig, info: ModelInfo) -> None:
        executor = config.executor
        dtype = self.default_dtype() if executor.dtype == "auto" else executor.dtype
        if executor.kv_cache_dtype not in ("auto", dtype):
            # The Triton kernels store and read the cache in the activations' dtype.
            raise ValueError(
                f"--kv-cache-dtype {executor.kv_cache_dtype}: the cuda backend keeps the KV "
                f"cache in the activations' dtype ({dtype})"
            )
        super().__init__(config, info)
        self._graphs: DecodeGraphs | None = None

    def default_dtype(self) -> str:
        return "bfloat16"

    def bind(
        self, model: LlamaModel | EncoderModel, kv_caches: KVCaches, lora: LoraWeights | None = None
    ) -> None:
        super().bind(model, kv_caches, lora)
        if isinstance(model, EncoderModel):
            return  # no decode steps to capture
        eager = self.config.executor.enforce_eager or model.tp.size > 1  # not captured yet
        if self.device.type == "cuda" and not eager:
            engine = self.config.engine
            max_len = engine.max_model_len or self.info.max_model_len
            self._graphs = DecodeGraphs(
                model,
                kv_caches,
                self.attention,
                capture_sizes(engine.max_num_seqs),
                -(-max_len // engine.block_size),
                engine.block_size,
            )

    def forward(self, step: DeviceStep) -> torch.Tensor:
        if self._graphs is not None and step.all_decode:
            hidden = self._graphs.replay(step)
            if hidden is not None:
                return hidden
        return super().forward(step)
