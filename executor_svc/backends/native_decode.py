"""Rows that each attend one token, one native call a layer (`kernels/native/decode_layer.c`)
instead of some twenty torch calls: with one or a few rows, Python and dispatch cost more than
the arithmetic. A row is a decode, or a token of a short prefill chunk attending its sequence
up to itself (`Route.FUSED`); long chunks take the model's layers, alone or beside decode rows
(`Route.SPLIT`). Both read and write the same KV cache. Rows that run a LoRA adapter get its
pairs added after each projection (`kernels/native/lora.c`)."""

from __future__ import annotations

import ctypes

import torch

from turnstile.executor_svc.backends.block_experts import BlockExperts
from turnstile.executor_svc.backends.packed_projection import NativeProjection
from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.model.layer_weights import LayerWeights
from turnstile.executor_svc.model.lora import FUSED, LoraBatch, LoraWeights
from turnstile.executor_svc.model.projection import Projection
from turnstile.executor_svc.model.routers import GroupedSigmoidRouter, SoftmaxRouter
from turnstile.kernels import cpu_native, native_attention
from turnstile.kernels.native_structs import (
    DecodeLayer,
    DecodeStep,
    LoraPair,
    Mixture,
    NativeWeight,
)
from turnstile.kernels.reference import DecodePlan
from turnstile.shared.model_info import ModelInfo

PROFILE_LABEL = "native::decode_layers"  # what `turnstile bench step` finds them by
FUSED_EXPERTS = (BlockExperts, TiledExperts)  # the experts decode_mixture.c calls


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _projection(projection: Projection) -> NativeProjection:
    if not isinstance(projection, NativeProjection):
        raise TypeError("the fused native layers need the cpu backend's projections")
    return projection


def _projections(layer: LayerWeights) -> tuple[Projection, ...]:
    """Its projections: a mixture's layer has no gate_up and down, or its shared experts'."""
    dense = () if layer.gate_up is None else (layer.gate_up, layer.down)
    return layer.qkv, layer.o_proj, *dense  # type: ignore[return-value]


def _mixture(layer: LayerWeights) -> tuple[Mixture, NativeWeight] | None:
    """A layer's experts as decode_mixture.c takes them, with the router's weight it points at;
    None where its MLP is dense."""
    experts = layer.experts
    if experts is None:
        return None
    assert isinstance(experts, FUSED_EXPERTS)
    router = experts.router
    logits = _projection(router.logits)
    weight = logits.native_weight()
    native = experts.native if isinstance(experts, TiledExperts) else experts.packed.native
    mixture = Mixture(
        ctypes.addressof(weight), _address(logits.bias), ctypes.addressof(native),
        isinstance(experts, TiledExperts), native.experts, router.top_k, router.normalize,
    )  # fmt: skip
    if isinstance(router, GroupedSigmoidRouter):
        mixture.correction = _address(router.correction)
        mixture.groups, mixture.kept_groups = router.groups, router.kept_groups
        mixture.scale = router.scale
    return mixture, weight


def _bias(projection: Projection) -> torch.Tensor | None:
    return _projection(projection).bias


class NativeDecode:
    @staticmethod
    def supports(info: ModelInfo, layers: list[LayerWeights]) -> bool:
        """decode_layer.c works in whole AVX vectors of 8 floats across heads and the MLP,
        on Llama's layer (not Gemma's norms, GELU, scale or second RoPE, nor Granite's scales,
        nor SmolLM3's layers without RoPE, nor OLMo 2's norms), its MLP or a mixture of
        experts routed by a softmax or GLM-4.5's grouped sigmoid, on AMX tiles or GGUF or MXFP4
        blocks, beside shared experts (decode_mixture.c); gpt-oss's biases and sinks."""
        llama_layer = info.hidden_act == "silu" and info.norms == "pre"
        llama_layer &= all(
            layer.experts is None
            or (isinstance(layer.experts, FUSED_EXPERTS)
                and isinstance(layer.experts.router, SoftmaxRouter | GroupedSigmoidRouter)
                and isinstance(layer.experts.router.logits, NativeProjection))
            for layer in layers
        )  # fmt: skip
        llama_layer &= info.qk_norm != "all"
        llama_layer &= not info.attention_scale and not info.local_rope_theta
        llama_layer &= not info.nope_layers
        llama_layer &= info.residual_multiplier == 1
        return info.head_dim % 8 == 0 and info.intermediate_size % 8 == 0 and llama_layer

    def __init__(
        self,
        info: ModelInfo,
        layers: list[LayerWeights],
        rotations: torch.Tensor,
        tiles: bool = False,
    ) -> None:
        """Every projection of `layers` one of the cpu backend's (`packed_projection.py`);
        `tiles`: a bf16 cache's attention on AMX tiles (`cpu_native.amx_tiles()` must hold)."""
        lib = cpu_native.library()
        assert lib is not None
        self._lib = lib
        self.info = info
        self._rotations = torch.view_as_real(rotations)  # [positions, dim / 2, 2] float32
        self._windows = [layer.window for layer in layers]
        self._isa = cpu_native.ISAS.index(cpu_native.best_isa())
        self._tiles = tiles
        self._scratch = torch.empty(0)
        self._lora: tuple[int, list[ctypes.Array], list[torch.Tensor]] | None = None
        # The structs the pointers below point at, kept alive as long as this object.
        self._descriptors = [
            [_projection(p).native_weight() for p in _projections(layer)] for layer in layers
        ]
        self._mixtures = [_mixture(layer) for layer in layers]
        self._layers = [
            DecodeLayer(
                _address(layer.input_norm),
                ctypes.pointer(qkv),
                _address(_bias(layer.qkv)),
                _address(layer.qk_norm),
                ctypes.pointer(o_proj),
                _address(_bias(layer.o_proj)),
                _address(layer.sinks),
                _address(layer.post_norm),
                *[ctypes.pointer(w) for w in mlp],  # gate_up, down; a mixture's shared ones
                mixture=None if mixture is None else ctypes.pointer(mixture[0]),
                shared_gate=_address(layer.shared_gate),
                shared_inner=info.shared_expert_size,
            )
            for layer, (qkv, o_proj, *mlp), mixture in zip(
                layers, self._descriptors, self._mixtures, strict=True
            )
        ]

    def _scratch_for(self, floats: int) -> torch.Tensor:
        """The layers' buffers, kept from step to step: a fresh one a step was fresh pages,
        each faulted in and zeroed by the kernel (60 MB for a 2,048-token chunk)."""
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def _lora_tables(self, weights: LoraWeights) -> list[ctypes.Array]:
        """Each layer's pairs as lora.c reads them, [projection][slot], rebuilt only when an
        adapter was added or dropped; B transposed so a row's share streams along `out`."""
        if self._lora is None or self._lora[0] != weights.version:
            count = 1 + max((slot for layer in weights.layers for pairs in layer.values()
                             for slot in pairs), default=0)  # fmt: skip
            kept: list[torch.Tensor] = []
            tables = []
            for layer in weights.layers:
                projections = []
                for name in FUSED:
                    pairs = (LoraPair * count)()
                    for slot, (a, b) in layer[name].items():
                        a, bt = a.float().contiguous(), b.float().t().contiguous()
                        kept += (a, bt)
                        pairs[slot] = LoraPair(a.data_ptr(), bt.data_ptr(), a.shape[0])
                    kept.append(pairs)  # type: ignore[arg-type]
                    projections.append(ctypes.cast(pairs, ctypes.c_void_p))
                tables.append((ctypes.c_void_p * len(FUSED))(*projections))
            self._lora = (weights.version, tables, kept)
        return self._lora[1]

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        plan: DecodePlan,
        slot_mapping: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The hidden states after the last layer (before the final norm); `hidden` is
        updated in place. `lora`: the rows that run adapters."""
        info, rows = self.info, hidden.shape[0]
        hidden = hidden.contiguous()
        rotations = self._rotations[positions].contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        shape = (rows, info.hidden_size, info.intermediate_size)
        shape += (info.num_heads, info.num_kv_heads, info.head_dim)
        scratch = self._scratch_for(self._lib.decode_layer_scratch(*shape))
        step = DecodeStep(
            *shape,
            info.rms_norm_eps,
            info.head_dim**-0.5,
            0,
            0,
            native_attention.CACHE_DTYPES.index(kv_caches[0][0].dtype),
            slots.data_ptr(),
            rotations.data_ptr(),
            plan.block_tables.data_ptr(),
            plan.block_tables.shape[1],
            plan.block_size,
            plan.seq_lens.data_ptr(),
            scratch.data_ptr(),
            0,
            self._isa,
            self._tiles,
        )
        tables: list[ctypes.Array | None] = [None] * len(self._layers)
        if lora is not None:
            tables = self._lora_tables(lora.weights)  # type: ignore[assignment]
            adapters = torch.full((rows,), -1, dtype=torch.int64)
            for slot, start, end in lora.segments:
                adapters[lora.tokens[start:end]] = slot
            step.adapters = adapters.data_ptr()
        pointer = ctypes.byref(step)
        with torch.profiler.record_function(PROFILE_LABEL):
            layers = zip(kv_caches, self._layers, self._windows, tables, strict=True)
            for (k_cache, v_cache), layer, window, table in layers:
                step.k_cache, step.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                step.window = window
                if self._lib.decode_layer(hidden.data_ptr(), ctypes.byref(layer), table, pointer):
                    raise MemoryError("a native decode layer could not allocate its buffers")
        return hidden
