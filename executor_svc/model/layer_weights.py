"""One decoder layer's weights, as the model's layer math and a backend's fused layers read
them, and the stacking of its projections' parts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnstile.executor_svc.model.experts import Experts
from turnstile.executor_svc.model.projection import Projection
from turnstile.kernels.quantized_weights import PackedWeight, QuantizedWeight, StackedWeight, stack

Weight = torch.Tensor | QuantizedWeight | StackedWeight | PackedWeight


def stack_rows(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Weights stacked by rows (q, k and v; gate and up): quantized where every part is (see
    `stack`); else dense in `dtype`."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    stacked = stack(quantized) if len(quantized) == len(parts) else None
    if stacked is not None:
        return stacked
    dense = [p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts]
    return torch.cat([p.to(dtype) for p in dense])  # type: ignore[union-attr]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor | None  # None: the input unnormed (OLMo 2)
    qkv: Projection  # q, k, v stacked; q and k rows in interleaved rotary order
    o_proj: Projection
    post_norm: torch.Tensor | None  # the MLP's input norm; None alike
    gate_up: Projection | None  # gate, up stacked; None where the MLP is `experts`
    down: Projection | None
    # [heads + kv_heads, head_dim]: each query and key head's RMSNorm weight (Qwen3, Gemma 3; OLMo
    # 2's across the heads), in interleaved rotary order; None where the family has none.
    qk_norm: torch.Tensor | None = None
    window: int = 0  # sliding window in tokens; 0: full attention
    # Gemma's and OLMo 2's norms of the attention's and the MLP's outputs, before their residuals.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    rope: int = 0  # which of the model's RoPE tables rotates this layer (Gemma 3: 1, sliding)
    experts: Experts | None = None  # a mixture of experts in place of the dense MLP
    sinks: torch.Tensor | None = None  # gpt-oss: [heads] float32, a logit in each softmax's sum
    shared_gate: torch.Tensor | None = None  # Qwen2-MoE: [1, hidden], its shared expert's gate
