"""A Llama-family decoder over a paged KV cache: Llama 3, SmolLM, Mistral (sliding window), Qwen2
(qkv bias), Qwen3 (q/k norm), Phi-3 (weights split at load), Gemma 2 and 3 (norms around each
block, GELU, scaled embeddings and scores, soft-capped logits and attention scores, Gemma 3's
sliding layers' own RoPE); Mixtral, Qwen3-MoE, gpt-oss and GLM-4.5 (a mixture of experts in
place of the MLP: `experts.py`; gpt-oss's biases on q, k, v and o, and its attention sinks;
GLM-4.5's and Qwen2-MoE's shared experts); a sequence classifier's head (`classifier.py`).

The model keeps the weights and the layer math, written as plain tensor code with fused
projections (one qkv and one gate-up matmul a layer, residual adds fused into the o and down
projections); the backend brings the projections and attention kernels, and runs the step
(`executor_svc/backend.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from turnstile.executor_svc.model import rope
from turnstile.executor_svc.model.attention import AttentionBatch
from turnstile.executor_svc.model.classifier import classifier_head
from turnstile.executor_svc.model.experts import ExpertsFactory, Glu, load_experts
from turnstile.executor_svc.model.layer_weights import LayerWeights, Weight, stack_rows
from turnstile.executor_svc.model.lora import LoraBatch
from turnstile.executor_svc.model.projection import Projection, ProjectionFactory
from turnstile.executor_svc.tensor_parallel import SINGLE, TensorParallel
from turnstile.kernels.quantized_weights import PackedWeight, QuantizedWeight, StackedWeight, pack
from turnstile.shared.model_info import ModelInfo

ALL = slice(None)
Adapted = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (projection(x), x) -> adapted


class LlamaModel:
    def __init__(
        self,
        info: ModelInfo,
        weights: Mapping[str, Weight],
        dtype: torch.dtype,
        activation_dtype: torch.dtype,
        device: torch.device,
        projection: ProjectionFactory,
        experts: ExpertsFactory,
        rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Weights in `dtype` on `device`; activations, norms and the KV cache in
        `activation_dtype`; projections, layers of experts and RMSNorm the backend's
        (`projection`, `experts`, `rms_norm(x, weight, eps)`); with `tp`, this rank's share of
        every layer (`tensor_parallel.py`). A `QuantizedWeight` stays as it is (the cpu
        backend's projections compute on its blocks)."""
        self.info, self._norm = info, rms_norm
        self.dtype = dtype
        self.activation_dtype = activation_dtype
        self.tp = tp
        queries, kv = tp.heads(info)
        head_dim = info.head_dim
        self.num_heads, self.num_kv_heads = queries.stop - queries.start, kv.stop - kv.start
        inner = tp.intermediate(info.intermediate_size)
        self.vocab = tp.vocab(info.vocab_size)

        def take(name: str, as_dtype: torch.dtype = dtype, rows: slice = ALL,
                 cols: slice = ALL) -> Weight:  # fmt: skip
            weight = weights[name]
            if isinstance(weight, QuantizedWeight):
                if tp.size > 1:
                    raise ValueError("quantized weights are not split across ranks")
                return weight[rows]
            share = weight[rows] if weight.dim() == 1 else weight[rows, cols]
            return share.to(device=device, dtype=as_dtype).contiguous()

        def heads(s: slice) -> slice:
            return slice(s.start * head_dim, s.stop * head_dim)

        def qkv(attn: str, kind: str) -> Weight:
            q, k, v = (weights[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            pairs = partial(
                rope.interleave_rotary_halves, head_dim=head_dim, rotary=info.rotary_dim
            )
            q = pairs(q, info.num_heads)[heads(queries)]
            k = pairs(k, info.num_kv_heads)[heads(kv)]
            stacked = stack_rows([q, k, v[heads(kv)]], dtype)
            if isinstance(stacked, QuantizedWeight | StackedWeight):
                return stacked
            return stacked.to(device=device, dtype=dtype).contiguous()

        def norm(name: str, present: bool = True) -> Any:
            """An RMSNorm weight in the activations' dtype (Gemma's scale by 1 + weight), or None
            where the family has no such norm."""
            return take(name, activation_dtype) + info.norm_offset if present else None

        embed = tp.padded_vocab(take("model.embed_tokens.weight", rows=self.vocab), info.vocab_size)
        # Quantized, packed once: its rows looked up there, and a tied head multiplies it.
        self.embed_weight = pack(embed) if isinstance(embed, QuantizedWeight) else embed
        self.norm = norm("model.norm.weight")
        tied = "lm_head.weight" not in weights
        head = (
            self.embed_weight
            if tied
            else tp.padded_vocab(take("lm_head.weight", rows=self.vocab), info.vocab_size)
        )
        self.lm_head = projection(head, None)
        self.classifier = classifier_head(info, weights, device)  # a sequence classifier's

        def qk_norm(attn: str) -> torch.Tensor | None:
            if not info.qk_norm:
                return None
            order = rope.rotary_order(head_dim, info.rotary_dim)
            heads = {"q": self.num_heads, "k": self.num_kv_heads}
            per_head = {p: weights[f"{attn}{p}_norm.weight"].view(-1, head_dim) for p in "qk"}
            rows = [per_head[p][:, order].expand(heads[p], -1) for p in "qk"]
            weight = torch.cat(rows).to(device=device, dtype=activation_dtype) + info.norm_offset
            return weight.contiguous()

        self._glu = Glu("silu" if info.hidden_act == "silu" else "gelu_tanh")

        def dense(prefix: str, rows: slice) -> dict[str, Any]:
            gate_up = [take(f"{prefix}{p}_proj.weight", rows=rows) for p in ("gate", "up")]
            return {
                "gate_up": projection(stack_rows(gate_up, dtype), None),
                "down": projection(take(prefix + "down_proj.weight", cols=rows), None),
            }

        def mlp(i: int, prefix: str) -> dict[str, Any]:
            """A layer's dense MLP, or its experts (shared ones as `gate_up` and `down`), each
            expert's rows split as a dense MLP's."""
            if i not in info.expert_layers:
                return dense(prefix, inner)
            rows = tp.intermediate(info.expert_intermediate_size)
            routed = load_experts(
                take, names, prefix, info, rows, activation_dtype, self._glu, experts, projection
            )
            shared, shared_mlp = info.shared_expert_size, {}
            if shared:
                shared_mlp = dense(prefix + "shared_experts.", tp.intermediate(shared))
            gate = prefix + "shared_expert_gate.weight"  # Qwen2-MoE's
            shared_mlp["shared_gate"] = take(gate, activation_dtype) if gate in weights else None
            return {"gate_up": None, "down": None, **shared_mlp, "experts": routed}

        sandwich = info.norms == "sandwich"  # Gemma: the MLP's input norm has its own name
        mlp_input_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        inputs, outputs = info.norms != "post", info.norms != "pre"  # which norms the blocks have

        # Each layer's RoPE table: the model's, the sliding layers' own, the identity (no RoPE).
        local, nope = bool(info.local_rope_theta), 1 + bool(info.local_rope_theta)
        # The experts' down biases (gpt-oss) on the first rank alone, as o's bias
        names = weights.keys() if tp.first else {n for n in weights if "down_proj.bias" not in n}
        self.layers = []
        for i in range(info.num_layers):
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            bias = qkv(attn, "bias") if attn + "q_proj.bias" in weights else None
            # o's bias (gpt-oss) on the first rank alone: the ranks' partial sums are summed
            o_bias = take(attn + "o_proj.bias") if attn + "o_proj.bias" in weights else None
            o_bias = o_bias if tp.first else None
            self.layers.append(
                LayerWeights(
                    input_norm=norm(prefix + "input_layernorm.weight", inputs),
                    qkv=projection(qkv(attn, "weight"), bias),
                    o_proj=projection(take(attn + "o_proj.weight", cols=heads(queries)), o_bias),
                    post_norm=norm(f"{prefix}{mlp_input_norm}.weight", inputs),
                    **mlp(i, prefix + "mlp."),
                    qk_norm=qk_norm(attn),
                    window=info.window(i),
                    attn_out_norm=norm(prefix + "post_attention_layernorm.weight", outputs),
                    mlp_out_norm=norm(prefix + "post_feedforward_layernorm.weight", outputs),
                    rope=nope if i in info.nope_layers else int(bool(local and info.window(i))),
                    sinks=take(attn + "sinks", torch.float32, queries)
                    if info.attention_sinks
                    else None,
                )
            )
        # cos + i sin per position and frequency, complex64 whatever the model's dtype: the
        # model's, then (Gemma 3) the sliding layers' own.
        self.rotations = [rope.rope_rotations(info).to(device)]
        if info.local_rope_theta:
            local = replace(info, rope_theta=info.local_rope_theta, rope_scaling=None)
            self.rotations.append(rope.rope_rotations(local).to(device))
        if info.nope_layers:  # their rotation is the identity
            self.rotations.append(torch.ones_like(self.rotations[0]))
        self.scale = info.attention_scale or info.head_dim**-0.5
        self.softcap = info.attn_logit_softcapping

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_weight, PackedWeight):
            rows = self.embed_weight.rows(input_ids, self.activation_dtype)
        elif self.tp.size == 1:
            rows = F.embedding(input_ids, self.embed_weight).to(self.activation_dtype)
        else:
            local = input_ids - self.vocab.start
            mine = (local >= 0) & (local < self.embed_weight.shape[0])
            rows = F.embedding(local.clamp(0, self.embed_weight.shape[0] - 1), self.embed_weight)
            rows = self.tp.all_reduce((rows * mine[:, None]).to(self.activation_dtype))
        return rows if self.info.embed_scale == 1 else rows * self.info.embed_scale

    def pooled(self, last: torch.Tensor) -> torch.Tensor:
        """A classifier's labels' logits of its last tokens' final hidden states, else those."""
        return last.float() if self.classifier is None else F.linear(last.float(), *self.classifier)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(hidden, self.norm)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else self._norm(x, weight, self.info.rms_norm_eps)

    def _qk_normed(self, qk: torch.Tensor) -> torch.Tensor:
        """[tokens, heads + kv_heads, head_dim], each head normed; OLMo 2: q, then k, across
        their heads."""
        eps, head_dim = self.info.rms_norm_eps, self.info.head_dim
        if self.info.qk_norm == "head":
            return F.rms_norm(qk, (head_dim,), None, eps)
        parts = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        flat = [
            F.rms_norm(part.flatten(1), (part.shape[1] * head_dim,), None, eps) for part in parts
        ]
        return torch.cat(flat, dim=1).view_as(qk)

    def layers_forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Every layer over `hidden` (embedded tokens), attended by `batch`, with the
        adapters of `lora`'s tokens; before the final norm."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.info.head_dim
        rotations = [table[positions].unsqueeze(1) for table in self.rotations]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            adapt = partial(self._adapted, lora=lora, layer=i)
            x = self._rms_norm(hidden, layer.input_norm)
            qk, v = (
                adapt(layer.qkv(x), x, "qkv")
                .view(-1, heads + 2 * kv_heads, head_dim)
                .split((heads + kv_heads, kv_heads), dim=1)
            )
            if layer.qk_norm is not None:
                qk = self._qk_normed(qk) * layer.qk_norm
            # Q and K heads rotate together: one set of ops a layer instead of two.
            q, k = rope.rotate(qk, rotations[layer.rope]).split((heads, kv_heads), dim=1)
            attn = batch.attend(q, k, v, k_cache, v_cache, self.scale, layer.window, self.softcap,
                                layer.sinks)  # fmt: skip
            attn = attn.reshape(-1, heads * head_dim)
            hidden = self._add_projected(
                hidden, layer.o_proj, attn, layer.attn_out_norm, partial(adapt, name="o_proj")
            )
            x = self._rms_norm(hidden, layer.post_norm)
            if layer.experts is not None:
                routed = layer.experts(x)
                if layer.gate_up is not None:  # shared experts, every token's (GLM-4.5, Qwen2-MoE)
                    assert layer.down is not None
                    gate, up = layer.gate_up(x).chunk(2, dim=-1)
                    shared = layer.down(self._glu(gate, up))
                    if layer.shared_gate is not None:  # Qwen2-MoE's
                        shared = shared * torch.sigmoid(F.linear(x, layer.shared_gate))
                    routed = routed + shared
                hidden = hidden + self.tp.all_reduce(routed)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate, up = adapt(layer.gate_up(x), x, "gate_up").chunk(2, dim=-1)
            down = partial(adapt, name="down")
            hidden = self._add_projected(hidden, layer.down, self._glu(gate, up),
                                         layer.mlp_out_norm, down)  # fmt: skip
        return hidden

    def _add_projected(
        self, hidden: torch.Tensor, projection: Projection, x: torch.Tensor,
        out_norm: torch.Tensor | None, adapted: Adapted,
    ) -> torch.Tensor:  # fmt: skip
        """hidden + projection(x) (`adapted`: with its adapters' share), the projection normed
        first where the family norms it (Gemma) and scaled where it scales it (Granite).
        Row-parallel: each rank's partial sum, the residual added once, then summed."""
        multiplier = self.info.residual_multiplier
        if out_norm is None and multiplier == 1:
            return self.tp.all_reduce(adapted(projection(x, hidden if self.tp.first else None), x))
        out = self.tp.all_reduce(adapted(projection(x), x))
        out = out if out_norm is None else self._rms_norm(out, out_norm)
        return hidden + (out if multiplier == 1 else out * multiplier)

    @staticmethod
    def _adapted(
        out: torch.Tensor, x: torch.Tensor, name: str, lora: LoraBatch | None, layer: int
    ) -> torch.Tensor:
        """A projection's output, with its adapters' share on their tokens' rows."""
        return out if lora is None else lora.add(out, x, layer, name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_vocab(self.lm_head(hidden).float(), self.info.vocab_size)
        if self.info.logits_scaling != 1:
            logits = logits / self.info.logits_scaling
        cap = self.info.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap
