"""A Llama-family decoder (Llama 3, Mistral, SmolLM; Qwen2's qkv bias) over a paged KV cache.

Written as plain tensor code with fused projections (one qkv and one gate-up matmul a layer,
residual adds fused into the o and down projections): on the CPU every avoided op is time
saved per layer per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from executor_svc.model.attention import AttentionBatch
from executor_svc.model.linear import Linear
from executor_svc.model.native_decode import NativeDecode
from kernels import cpu_native, native_attention
from shared.model_info import ModelInfo


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


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


def interleave_rotary_halves(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output dims from (0..d/2-1, d/2..d-1) to (0, d/2, 1, d/2+1, ...).

    RoPE rotates dims i and i + d/2 together; side by side they are one complex number, so one
    complex multiply rotates a whole head. Q and K are permuted alike, which leaves every q.k,
    and so attention, unchanged; V is not touched."""
    order = torch.arange(head_dim).view(2, -1).t().reshape(-1)
    return weight.reshape(heads, head_dim, -1)[:, order].reshape(weight.shape)


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
        # The native CPU kernels multiply bf16 weights in fp32 arithmetic, so with them the
        # activations and KV cache stay fp32: bf16 halves the weight bytes, not the precision.
        native = cpu_native.multiplies(device, dtype)
        self.activation_dtype = torch.float32 if native else dtype

        def take(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            return weights[name].to(device=device, dtype=as_dtype).contiguous()

        def qkv(attn: str, kind: str) -> torch.Tensor:
            q, k, v = (take(f"{attn}{p}_proj.{kind}") for p in "qkv")
            q = interleave_rotary_halves(q, info.num_heads, info.head_dim)
            k = interleave_rotary_halves(k, info.num_kv_heads, info.head_dim)
            return torch.cat((q, k, v))

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight", self.activation_dtype)
        tied = "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed if tied else take("lm_head.weight"))
        self.layers = []
        for i in range(info.num_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            bias = qkv(attn, "bias") if attn + "q_proj.bias" in weights else None
            self.layers.append(
                LayerWeights(
                    input_norm=take(prefix + "input_layernorm.weight", self.activation_dtype),
                    qkv=Linear(qkv(attn, "weight"), bias),
                    o_proj=Linear(take(attn + "o_proj.weight")),
                    post_norm=take(
                        prefix + "post_attention_layernorm.weight", self.activation_dtype
                    ),
                    gate_up=Linear(
                        torch.cat((take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")))
                    ),
                    down=Linear(take(mlp + "down_proj.weight")),
                )
            )
        positions = torch.arange(info.max_model_len, dtype=torch.float32)
        angles = torch.outer(positions, rope_inverse_frequencies(info))
        # cos + i sin per position and frequency, complex64 whatever the model's dtype.
        self.rotations = torch.polar(torch.ones_like(angles), angles).to(device)
        self.scale = info.head_dim**-0.5
        fused = native and NativeDecode.supports(info)
        self.native_decode = NativeDecode(info, self.layers, self.rotations) if fused else None

    def fuses(self, kernels: ModuleType) -> bool:
        """Whether steps attended by `kernels` run through the fused native layers."""
        return self.native_decode is not None and kernels is native_attention

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.info.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """RoPE on heads whose dims are interleaved pairs (`interleave_rotary_halves`)."""
        pairs = x.unflatten(-1, (-1, 2))
        if pairs.dtype != torch.float32:  # no complex type pairs with bf16
            pairs = pairs.float()
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * rotations).flatten(-2)
        return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        hidden = F.embedding(input_ids, self.embed).to(self.activation_dtype)
        decodes, prefills = batch.decode_tokens, batch.prefill_tokens
        fused = self.fuses(batch.kernels)
        if fused and batch.token_plan is not None:
            hidden = self.native_decode(
                hidden, positions, batch.token_plan, batch.slot_mapping, kv_caches
            )
        elif not fused or not len(decodes):
            hidden = self._torch_layers(hidden, positions, batch, kv_caches)
        else:
            # Long prefill chunks through the torch layers, the decode rows beside them through
            # the fused ones. The halves touch different sequences' KV (shared prefix blocks
            # are full and only read), so their order does not matter.
            hidden[prefills] = self._torch_layers(
                hidden[prefills], positions[prefills], batch.prefill_only(), kv_caches
            )
            hidden[decodes] = self.native_decode(
                hidden[decodes],
                positions[decodes],
                batch.decode_plan,
                batch.slot_mapping[decodes],
                kv_caches,
            )
        return self._rms_norm(hidden, self.norm)

    def _torch_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        info = self.info
        heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim
        rotations = self.rotations[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = self._rms_norm(hidden, layer.input_norm)
            qk, v = (
                layer.qkv(x)
                .view(-1, heads + 2 * kv_heads, head_dim)
                .split((heads + kv_heads, kv_heads), dim=1)
            )
            # Q and K heads rotate together: one set of ops a layer instead of two.
            q, k = self._rotate(qk, rotations).split((heads, kv_heads), dim=1)
            attn = batch.attend(q, k, v, k_cache, v_cache, self.scale)
            hidden = layer.o_proj(attn.reshape(-1, heads * head_dim), residual=hidden)
            x = self._rms_norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = layer.down(F.silu(gate) * up, residual=hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
