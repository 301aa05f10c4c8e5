"""The CPU backend on the native kernels (`kernels/native/*.c`, AVX2 and FMA): projections on
weights packed in panels (GGUF blocks requantized for AMX-INT8 tiles where the CPU has them,
`--cpu-products`), decode attention reading the paged cache in place (a bfloat16 or fp8 one
on AMX-BF16 tiles where the CPU has them, `--cpu-attention`), whole decode layers in one call
for steps of few tokens (`native_decode.py`), a GGUF file's experts on their blocks
(`block_experts.py`), and bf16 experts on AMX-BF16 tiles where the CPU has them
(`tiled_experts.py`). Prompt chunks' attention runs each token as a decode row where the
cache is on the tiles or SDPA cannot take the chunk (a window, soft cap or sinks), and is the
torch reference's batched SDPA elsewhere. Figures: docs/benchmarks.md."""

from __future__ import annotations

import functools
import logging

import torch

from turnstile.executor_svc.backend import Backend, FusedRows, KVCaches, Route
from turnstile.executor_svc.backends.block_experts import BlockExperts
from turnstile.executor_svc.backends.native_decode import NativeDecode
from turnstile.executor_svc.backends.packed_projection import (
    QUANTIZED,
    NativeProjection,
    PackedProjection,
    QuantizedProjection,
    TiledProjection,
)
from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.backends.torch_reference import TORCH_ATTENTION
from turnstile.executor_svc.model.attention import PagedAttention
from turnstile.executor_svc.model.encoder import EncoderModel
from turnstile.executor_svc.model.experts import (
    BlockExpertWeights,
    ExpertWeights,
    MixtureOfExperts,
)
from turnstile.executor_svc.model.layer_weights import Weight
from turnstile.executor_svc.model.llama import LlamaModel
from turnstile.executor_svc.model.lora import LoraBatch, LoraWeights
from turnstile.executor_svc.model.routers import Router
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.step_layout import StepLayout
from turnstile.kernels import cpu_native, native_attention, native_sampling, reference
from turnstile.kernels.int8_tiles import Int8Tiles
from turnstile.kernels.quantized_weights import (
    PackedWeight,
    QuantizedWeight,
    StackedWeight,
    pack,
)
from turnstile.shared.model_info import ModelInfo

log = logging.getLogger(__name__)
NATIVE_DTYPES = ("float32", "bfloat16", "auto")


def native_attention_for(tiles: bool) -> PagedAttention:
    """Attention reads the paged cache in place (a bf16 or fp8 one on AMX tiles where
    `tiles`), prompt tokens as rows where that is faster; KV writes stay the reference's."""
    decode = functools.partial(native_attention.paged_decode_attention, tiles=tiles)
    prefill = functools.partial(native_attention.paged_prefill_attention, tiles=tiles)
    return PagedAttention(reference.write_kv, decode, prefill)


class CpuNativeBackend(Backend):
    name = "cpu"

    @staticmethod
    def runs(config: RunnerConfig) -> bool:
        """Whether this backend can serve `config` here."""
        return (
            config.executor.device == "cpu"
            and config.executor.dtype in NATIVE_DTYPES
            and cpu_native.library() is not None
        )

    def __init__(self, config: RunnerConfig, info: ModelInfo) -> None:
        if not self.runs(config):
            raise ValueError(
                f"the cpu backend needs device cpu, dtype float32 or bfloat16 and the native "
                f"kernels (AVX2, FMA, a C compiler); got device {config.executor.device}, "
                f"dtype {config.executor.dtype}, kernels "
                f"{'built' if cpu_native.library() else 'unavailable'}"
            )
        super().__init__(config, info)
        native = info.head_dim % 8 == 0  # attention.c works in whole vectors of 8 floats
        self.attention_tiles = self._attention_tiles()
        self.attention = native_attention_for(self.attention_tiles) if native else TORCH_ATTENTION
        self.product_tiles = self._product_tiles()
        self.bf16_tiles = self._bf16_tiles()
        self.kept_blocks = 0  # quantized weights int8 would not keep (Int8Tiles.faithful)
        self._native: NativeDecode | None = None
        self._quantized = False
        self._rounded = False  # bf16 weights on AMX-BF16 tiles: rows rounded to bf16

    def _attention_tiles(self) -> bool:
        """Whether a bf16 cache's attention runs on AMX-BF16 tiles (`--cpu-attention`)."""
        chosen = self.config.executor.cpu_attention
        if chosen == "tiles" and not cpu_native.amx_tiles():
            raise ValueError("--cpu-attention tiles needs a CPU with AMX-BF16 and AVX512-BF16")
        return chosen != "rows" and cpu_native.amx_tiles()

    def _product_tiles(self) -> bool:
        """Whether GGUF weights are requantized for AMX-INT8 tiles (`--cpu-products`)."""
        chosen = self.config.executor.cpu_products
        if chosen == "tiles" and not cpu_native.amx_int8():
            raise ValueError("--cpu-products tiles needs a CPU with AMX-INT8 and AVX-512")
        return chosen != "blocks" and cpu_native.amx_int8()

    def _bf16_tiles(self) -> bool:
        """Whether bf16 weights multiply on AMX-BF16 tiles (`--cpu-bf16-products`)."""
        chosen = self.config.executor.cpu_bf16_products
        if chosen == "tiles" and not cpu_native.amx_tiles():
            raise ValueError("--cpu-bf16-products tiles needs a CPU with AMX-BF16 and AVX512-BF16")
        return chosen != "rows" and cpu_native.amx_tiles()

    def default_dtype(self) -> str:
        return "bfloat16"  # streamed as bf16, on AMX-BF16 tiles or in fp32 (`PackedProjection`)

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def kv_cache_dtype(self, activation_dtype: torch.dtype, quantized: bool) -> torch.dtype:
        """auto on quantized weights, or bf16 ones on AMX-BF16 tiles: bfloat16, half the bytes
        decode attention reads (its cost in perplexity: docs/benchmarks.md)."""
        executor = self.config.executor
        rounded = self.bf16_tiles and executor.dtype in ("auto", "bfloat16")
        if (quantized or rounded) and executor.kv_cache_dtype == "auto":
            return torch.bfloat16
        return super().kv_cache_dtype(activation_dtype, quantized)

    def keeps_quantized(self) -> bool:
        engine, executor = self.config.engine, self.config.executor
        chosen = self.stored_quantization()
        if chosen:
            if engine.tensor_parallel_size > 1:
                raise ValueError(
                    f"--quantization {chosen} runs on one rank (--tensor-parallel-size 1)"
                )
            return True
        # fp8 checkpoints are dequantized: no CPU kernel here multiplies e4m3 weights
        stored = engine.model_path.suffix == ".gguf" or self.info.weight_type in ("int", "mxfp4")
        auto = executor.quantization == "auto" and executor.dtype == "auto"
        return auto and stored and engine.tensor_parallel_size == 1

    def projection(self, weight: Weight, bias: torch.Tensor | None) -> NativeProjection:
        quantized = isinstance(weight, (QuantizedWeight, StackedWeight, PackedWeight))
        if quantized and self.product_tiles:
            values = weight.dequantize()
            tiles = Int8Tiles.from_values(values)
            if tiles.faithful(values):
                return TiledProjection(tiles, bias)
            self.kept_blocks += 1
        if isinstance(weight, StackedWeight):
            return QuantizedProjection([pack(part) for part in weight.parts], bias)
        if isinstance(weight, QuantizedWeight):
            weight = pack(weight)
        if isinstance(weight, PackedWeight):
            return QuantizedProjection([weight], bias)
        tiles = self.bf16_tiles and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0
        return PackedProjection(weight, bias, tiles)

    def experts(
        self, router: Router, weights: ExpertWeights | BlockExpertWeights
    ) -> MixtureOfExperts:
        """Experts in GGUF blocks on them (`block_experts.py`), bf16 experts on AMX-BF16 tiles
        where the CPU has them (`tiled_experts.py`)."""
        if isinstance(weights, BlockExpertWeights):
            if BlockExperts.takes(weights):
                return BlockExperts(router, weights)
            weights = weights.dense(torch.float32)
        if self.bf16_tiles and TiledExperts.takes(weights):
            return TiledExperts(router, weights)
        return super().experts(router, weights)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The fused layers' own (`rms_norm.c`): 3.6x torch's on 4,096 rows (docs/benchmarks.md)."""
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        return cpu_native.rms_norm(x, weight, eps)

    def bind(
        self, model: LlamaModel | EncoderModel, kv_caches: KVCaches, lora: LoraWeights | None = None
    ) -> None:
        super().bind(model, kv_caches, lora)
        if isinstance(model, EncoderModel):
            return  # its layers are its own, through the projections packed here
        if model.tp.size == 1 and NativeDecode.supports(model.info, model.layers):  # whole layers
            self._native = NativeDecode(
                model.info, model.layers, model.rotations[0], self.attention_tiles
            )
        projections = [p for layer in model.layers for p in (layer.qkv, layer.down)]
        self._quantized = any(isinstance(p, QUANTIZED) for p in projections)
        self._rounded = any(isinstance(p, PackedProjection) and p.tiles for p in projections)
        if self._quantized:  # which products they take: the tiles' int8 or the file's blocks
            log.info("quantized projections on %s", "AMX-INT8 tiles" if self.product_tiles
                     else f"their GGUF blocks ({cpu_native.best_isa()})")  # fmt: skip
        blocks = sum(isinstance(layer.experts, BlockExperts) for layer in model.layers)
        if blocks:
            log.info("the experts of %d layers on their GGUF blocks (%s)", blocks,
                     cpu_native.best_isa())  # fmt: skip
        if self.kept_blocks:
            log.warning("%d quantized weights kept their GGUF blocks: int8 a feature would lose "
                        "their small blocks (Int8Tiles.faithful)", self.kept_blocks)  # fmt: skip

    def route(self, layout: StepLayout) -> Route:
        """With one or a few rows, Python and dispatch cost more than the arithmetic: decode
        rows, and the tokens of short prefill chunks, go through the fused layers. On quantized
        weights, or bf16 ones on AMX-BF16 tiles, every token does: int8 or bf16 activations
        turn two routes' last-bit differences into different codes, so one route keeps a
        token's result the same bits in any step (a request recomputed after a preemption or an
        executor's restart, or run alone or batched, generates the same tokens)."""
        if self._native is None:
            return Route.LAYERS
        one_route = self._quantized or self._rounded
        if one_route or not len(layout.prefill_rows) or layout.short_prefill():
            return Route.FUSED  # a LoRA adapter's rows too (`kernels/native/lora.c`)
        split = len(layout.decode_rows) and not layout.inputs.lora_segments
        return Route.SPLIT if split else Route.LAYERS

    def fused_layers(
        self, hidden: torch.Tensor, positions: torch.Tensor, rows: FusedRows,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # fmt: skip
        assert self._native is not None
        return self._native(hidden, positions, rows.plan, rows.slot_mapping, self.kv_caches, lora)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return native_sampling.argmax(logits)

    def race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return native_sampling.race(probs, seeds)
