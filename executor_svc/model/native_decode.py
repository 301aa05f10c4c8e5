"""Rows that each attend one token, one native call a layer (`kernels/native/decode_layer.c`)
instead of some twenty torch calls: with one or a few rows, Python and dispatch cost more than
the arithmetic. A row is a decode, or a token of a short prefill chunk attending its sequence
up to itself (`AttentionBatch.token_plan`); long chunks take the torch path in llama.py, alone
or beside decode rows. Both paths read and write the same KV cache."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from executor_svc.model.linear import Linear
from kernels import cpu_native
from kernels.native_attention import DecodePlan
from shared.model_info import ModelInfo

if TYPE_CHECKING:  # llama.py imports this module
    from executor_svc.model.llama import LayerWeights

PROFILE_LABEL = "native::decode_layers"  # what `turnstile bench step` finds them by


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeDecode:
    @staticmethod
    def supports(info: ModelInfo) -> bool:
        """decode_layer.c works in whole AVX vectors of 8 floats across heads and the MLP."""
        return info.head_dim % 8 == 0 and info.intermediate_size % 8 == 0

    def __init__(
        self, info: ModelInfo, layers: list[LayerWeights], rotations: torch.Tensor
    ) -> None:
        """Every projection of `layers` native-packed, all in one dtype."""
        lib = cpu_native.library()
        assert lib is not None
        self._lib = lib
        self.info = info
        self._rotations = torch.view_as_real(rotations)  # [positions, dim / 2, 2] float32
        projections: list[Linear] = [
            p for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        assert all(p.packed is not None for p in projections)
        bf16 = projections[0].packed.dtype == torch.bfloat16  # type: ignore[union-attr]
        self._layer = lib.decode_layer_bf16 if bf16 else lib.decode_layer_f32
        self._weights = [
            tuple(
                _address(t)
                for t in (
                    layer.input_norm,
                    layer.qkv.packed,
                    layer.qkv.bias,
                    layer.o_proj.packed,
                    layer.post_norm,
                    layer.gate_up.packed,
                    layer.down.packed,
                )
            )
            for layer in layers
        ]

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        plan: DecodePlan,
        slot_mapping: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The hidden states after the last layer (before the final norm); `hidden` is
        updated in place."""
        info, rows = self.info, hidden.shape[0]
        hidden = hidden.contiguous()
        rotations = self._rotations[positions].contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        shape = (rows, info.hidden_size, info.intermediate_size)
        shape += (info.num_heads, info.num_kv_heads, info.head_dim)
        scratch = hidden.new_empty(self._lib.decode_layer_scratch(*shape))
        step = cpu_native.DecodeStep(
            *shape,
            info.rms_norm_eps,
            info.head_dim**-0.5,
            0,
            0,
            slots.data_ptr(),
            rotations.data_ptr(),
            plan.block_tables.data_ptr(),
            plan.block_tables.shape[1],
            plan.block_size,
            plan.seq_lens.data_ptr(),
            scratch.data_ptr(),
        )
        pointer = ctypes.byref(step)
        with torch.profiler.record_function(PROFILE_LABEL):
            for (k_cache, v_cache), weights in zip(kv_caches, self._weights, strict=True):
                step.k_cache, step.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                if self._layer(hidden.data_ptr(), *weights, pointer):
                    raise MemoryError("native decode attention could not allocate its scores")
        return hidden
