"""The seam between the model and a device: one `Backend` per device (`executor_svc/backends/`).

A backend moves a step's inputs onto its device, brings the projections and attention kernels
the model's layers call, chooses the step's route (`route`, the one place that does), runs it
(`forward`), and samples on the device. The model keeps the weights and the layer math.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from turnstile.executor_svc.cpu_runtime import (
    keep_freed_memory,
    pin_rank,
    return_freed_memory,
    return_loading_memory,
)
from turnstile.executor_svc.model.attention import AttentionBatch, PagedAttention
from turnstile.executor_svc.model.encoder import EncoderBatch, EncoderModel
from turnstile.executor_svc.model.experts import (
    BlockExpertWeights,
    Experts,
    ExpertWeights,
    MixtureOfExperts,
)
from turnstile.executor_svc.model.layer_weights import Weight
from turnstile.executor_svc.model.llama import LlamaModel
from turnstile.executor_svc.model.lora import LoraBatch, LoraWeights
from turnstile.executor_svc.model.projection import DenseProjection, Projection
from turnstile.executor_svc.model.routers import Router
from turnstile.executor_svc.plan_applier import StepInputs
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.sampler import (
    Sampled,
    SamplingArrays,
    SamplingBatch,
    hashed_race,
    sample,
)
from turnstile.executor_svc.staging import Staging
from turnstile.executor_svc.step_in_flight import Carry
from turnstile.executor_svc.step_layout import StepLayout
from turnstile.kernels.quantized_weights import PackedWeight, QuantizedWeight
from turnstile.kernels.reference import DecodePlan, PrefillPlan
from turnstile.shared.model_info import ModelInfo

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# `--kv-cache-dtype`'s, vLLM's names: fp8 is e4m3, with no scale (1.0).
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_DTYPES = DTYPES | FP8


class Route(enum.Enum):
    LAYERS = "layers"  # every token through the model's layers, attention batched by kind
    FUSED = "fused"  # every token a row of the backend's fused layers, to itself as a decode
    SPLIT = "split"  # prefill chunks through the model's layers, decode rows fused
    ENCODER = "encoder"  # whole prompts through an encoder, each attending all of itself


@dataclass(slots=True, frozen=True)
class FusedRows:
    """Tokens for a backend's fused layers: each attends its sequence up to itself."""

    plan: DecodePlan
    slot_mapping: torch.Tensor
    tokens: torch.Tensor | None  # which of the step's tokens; None: all of them


@dataclass(slots=True, frozen=True)
class DeviceStep:
    """One step's inputs on the device, laid out for its route."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sampling: SamplingBatch
    layers: AttentionBatch | None  # tokens through the model's layers
    layer_tokens: torch.Tensor | None  # which tokens; None: all of them
    fused: FusedRows | None
    lora: LoraBatch | None = None  # the tokens that run LoRA adapters
    encoder: EncoderBatch | None = None  # an encoder's sequences

    @property
    def all_decode(self) -> bool:
        """Decode rows alone, through the layers (as a CUDA graph captures them)."""
        layers = self.layers
        return (
            self.fused is None and layers is not None and layers.prefill is None and not self.lora
        )


class Backend(ABC):
    """Subclasses name themselves and set their kernels (`attention`)."""

    name: ClassVar[str]
    attention: PagedAttention

    def __init__(self, config: RunnerConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        executor = config.executor
        # Tensor-parallel ranks on GPUs: rank R on cuda:R.
        self.device = torch.device(
            executor.device, executor.rank if executor.device == "cuda" else None
        )
        if self.device.type == "cpu":
            return_freed_memory()
            pin_rank(executor.rank, config.engine.tensor_parallel_size)
        self.staging = Staging(self.device)
        self.model: LlamaModel | EncoderModel | None = None
        self.kv_caches: KVCaches = []
        self.lora: LoraWeights | None = None

    @abstractmethod
    def default_dtype(self) -> str:
        """The weights' dtype for `--dtype auto`: the fastest this device multiplies well."""

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype of activations and the KV cache for weights of `weight_dtype`."""
        return weight_dtype

    def kv_cache_dtype(self, activation_dtype: torch.dtype, quantized: bool) -> torch.dtype:
        """The KV cache's dtype (`--kv-cache-dtype`; auto: the activations'); `quantized`:
        whether the model's GGUF blocks stay quantized."""
        chosen = self.config.executor.kv_cache_dtype
        return activation_dtype if chosen == "auto" else KV_DTYPES[chosen]

    def keeps_quantized(self) -> bool:
        """Whether the model's GGUF blocks, or a checkpoint's int matrices, stay
        quantized (`--quantization`); only the cpu backend computes on them."""
        chosen = self.stored_quantization()
        if chosen:
            raise ValueError(
                f"--quantization {chosen} runs on the cpu backend, not the {self.name} backend"
            )
        return False

    def stored_quantization(self) -> str:
        """`--quantization`'s method ("" for auto and none), refused where the model is not
        stored so (as vLLM refuses a method its checkpoint's config does not name)."""
        chosen, engine = self.config.executor.quantization, self.config.engine
        stored = "gguf" if engine.model_path.suffix == ".gguf" else self.info.quantization
        if chosen in ("auto", "none") or chosen == stored:
            return "" if chosen in ("auto", "none") else chosen
        model = engine.model
        if chosen == "gguf":
            raise ValueError(f"--quantization gguf needs a GGUF file, not {model}")
        raise ValueError(
            f"--quantization {chosen} needs a {chosen.upper()} checkpoint; {model}'s "
            f"config.json names {stored.upper() or 'no quantization'}"
        )

    def projection(self, weight: Weight, bias: torch.Tensor | None) -> Projection:
        if isinstance(weight, (QuantizedWeight, PackedWeight)):
            raise TypeError(f"the {self.name} backend computes on dequantized weights")
        return DenseProjection(weight, bias)

    def experts(
        self, router: Router, weights: ExpertWeights | BlockExpertWeights
    ) -> MixtureOfExperts:
        if isinstance(weights, BlockExpertWeights):
            raise TypeError(f"the {self.name} backend computes on dequantized weights")
        return Experts(router, weights)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight over the last dim, for the model's layers."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def bind(
        self, model: LlamaModel | EncoderModel, kv_caches: KVCaches, lora: LoraWeights | None = None
    ) -> None:
        """The model, cache and LoRA adapters every later step runs on (an encoder: no cache)."""
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        if self.device.type == "cpu":  # loading's transients returned as they were freed
            return_loading_memory()
            keep_freed_memory()

    def route(self, layout: StepLayout) -> Route:
        """Every step through the layers; a backend with fused layers sends there what they
        run faster; a LoRA adapter's tokens (`layout.inputs.lora_segments`) only where its
        fused layers take adapters."""
        return Route.LAYERS

    def upload(
        self, inputs: StepInputs, sampling: SamplingArrays, carry: Carry | None = None
    ) -> DeviceStep:
        """The step's host arrays, laid out for its route, onto the device in one copy; the
        tokens the step before samples, taken from it there (`carry`)."""
        layout = StepLayout(inputs)
        route = Route.ENCODER if self.info.encoder_only else self.route(layout)
        arrays = layout.arrays(route.value) | sampling.arrays()
        if carry is not None:
            arrays |= {"carry_to": carry.to, "carry_from": carry.source}
        on = self.staging.upload(arrays)
        if carry is not None:
            on["input_ids"][on["carry_to"]] = carry.tokens[on["carry_from"]].long()
        size = self.config.engine.block_size
        common = {
            "input_ids": on["input_ids"],
            "positions": on["positions"],
            "logits_indices": on["logits_indices"],
            "sampling": SamplingBatch(sampling, on),
        }
        if inputs.lora_segments:
            assert route is not Route.SPLIT and self.lora is not None
            common["lora"] = LoraBatch(self.lora, on["lora_tokens"], inputs.lora_segments)
        if route is Route.ENCODER:
            bounds = tuple(inputs.query_start_loc.tolist())
            rows = EncoderBatch(on["encoder_rows"], on["encoder_starts"], bounds,
                                on.get("token_types"))  # fmt: skip
            return DeviceStep(**common, layers=None, layer_tokens=None, fused=None, encoder=rows)
        if route is Route.FUSED:
            plan = DecodePlan(on["fused_tables"], on["fused_lens"], size)
            fused = FusedRows(plan, on["slot_mapping"], None)
            return DeviceStep(**common, layers=None, layer_tokens=None, fused=fused)
        prefill = None
        if layout.prefill_rows.size:
            prefill = PrefillPlan(
                on["prefill_tables"],
                on["prefill_lens"],
                on["prefill_start"],
                layout.longest,
                layout.from_start,
            )
        if route is Route.SPLIT:
            plan = DecodePlan(on["decode_tables"], on["decode_lens"], size)
            fused = FusedRows(plan, on["decode_slots"], on["decode_tokens"])
            layers = AttentionBatch(self.attention, on["prefill_slots"], None, None, prefill, None)
            return DeviceStep(
                **common, layers=layers, layer_tokens=on["prefill_tokens"], fused=fused
            )
        decode = None
        if layout.decode_rows.size:
            decode = self.attention.plan_decode(on["decode_tables"], on["decode_lens"], size)
        layers = AttentionBatch(
            self.attention,
            on["slot_mapping"],
            decode,
            on.get("decode_tokens"),
            prefill,
            on.get("prefill_tokens"),
        )
        return DeviceStep(**common, layers=layers, layer_tokens=None, fused=None)

    def forward(self, step: DeviceStep) -> torch.Tensor:
        """The hidden states after the final norm, one row per token of the step."""
        model = self.model
        assert model is not None, "bind() first"
        if isinstance(model, EncoderModel):
            assert step.encoder is not None
            return model.forward(step.input_ids, step.positions, step.encoder)
        hidden = model.embed(step.input_ids)
        if step.layers is not None:
            tokens = step.layer_tokens
            if tokens is None:
                hidden = model.layers_forward(
                    hidden, step.positions, step.layers, self.kv_caches, step.lora
                )
            else:
                hidden[tokens] = model.layers_forward(
                    hidden[tokens], step.positions[tokens], step.layers, self.kv_caches
                )
        if step.fused is not None:
            # The two halves touch different sequences' KV (shared prefix blocks are full and
            # only read), so their order does not matter.
            tokens = step.fused.tokens
            if tokens is None:
                hidden = self.fused_layers(hidden, step.positions, step.fused, step.lora)
            else:
                hidden[tokens] = self.fused_layers(
                    hidden[tokens], step.positions[tokens], step.fused
                )
        return model.final_norm(hidden)

    def fused_layers(
        self, hidden: torch.Tensor, positions: torch.Tensor, rows: FusedRows,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Every layer for rows that each attend one token; only where `route` picks it."""
        raise NotImplementedError(f"the {self.name} backend has no fused layers")

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
        return sample(logits, batch, self.argmax, self.race)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return hashed_race(probs, seeds)
