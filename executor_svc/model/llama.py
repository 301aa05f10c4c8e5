"""A Llama-family decoder (Llama 3, Mistral, SmolLM; Qwen2's qkv bias) over a paged KV cache.

Written as plain tensor code with fused projections (one qkv and one gate-up matmul a layer):
on the CPU every avoided op is time saved per layer per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.model.attention import AttentionBatch
from shared.model_info import ModelInfo


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rope_inverse_frequencies(info: ModelInfo) -> torch.Tensor:
    dim = info.head_dim
    inv_freq = 1.0 / (info.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = info.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


class LlamaModel:
    def __init__(
        self,
        info: ModelInfo,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.info = info
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if "lm_head.weight" not in weights else take("lm_head.weight")
        self.layers = []
        for i in range(info.num_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            bias = None
            if attn + "q_proj.bias" in weights:
                bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
            self.layers.append(
                LayerWeights(
                    input_norm=take(prefix + "input_layernorm.weight"),
                    qkv=torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]),
                    qkv_bias=bias,
                    o_proj=take(attn + "o_proj.weight"),
                    post_norm=take(prefix + "post_attention_layernorm.weight"),
                    gate_up=torch.cat(
                        [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
                    ),
                    down=take(mlp + "down_proj.weight"),
                )
            )
        positions = torch.arange(info.max_model_len, dtype=torch.float32)
        angles = torch.outer(positions, rope_inverse_frequencies(info))
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.scale = info.head_dim**-0.5

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.info.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        info = self.info
        q_size = info.num_heads * info.head_dim
        kv_size = info.num_kv_heads * info.head_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        hidden = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = self._rotate(q.view(-1, info.num_heads, info.head_dim), cos, sin)
            k = self._rotate(k.view(-1, info.num_kv_heads, info.head_dim), cos, sin)
            v = v.view(-1, info.num_kv_heads, info.head_dim)
            attn = batch.attend(q, k, v, k_cache, v_cache, self.scale)
            hidden = hidden + F.linear(attn.reshape(-1, q_size), layer.o_proj)
            x = self._rms_norm(hidden, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
        return self._rms_norm(hidden, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
