"""One decoder layer's weights, as the model's layer math and a backend's fused layers read
them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnstile.executor_svc.model.experts import Experts
from turnstile.executor_svc.model.projection import Projection


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
