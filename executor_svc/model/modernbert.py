"""ModernBERT (`shared/encoder_support.py`): an encoder as BERT's (`encoder.py`: whole prompts,
no KV cache, one pooled vector a sequence), with pre-norm layers without biases, rotary
positions (a base for the global layers and one for the local ones), local layers that attend
only the tokens within half their window on either side, and a GeGLU MLP. A classifier pools
as its config says (CLS or mean), then a dense layer, GELU and LayerNorm, then its labels'."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnstile.executor_svc.model.encoder import ACTIVATIONS, EncoderBatch, EncoderModel
from turnstile.executor_svc.model.layer_weights import Weight
from turnstile.executor_svc.model.projection import Projection, ProjectionFactory
from turnstile.shared.model_info import ModelInfo

Tensor = torch.Tensor
Norm = tuple[Tensor, Tensor | None]  # LayerNorm's weight, and its bias where it has one


@dataclass(slots=True, frozen=True)
class ModernBertLayer:
    attention_norm: Norm | None  # None: the first layer reads the embeddings' norm
    qkv: Projection
    out: Projection
    mlp_norm: Norm
    up: Projection  # GeGLU's input and gate, stacked
    down: Projection
    window: int  # tokens within window // 2 on either side; 0: every token


class ModernBertModel(EncoderModel):
    def __init__(
        self,
        info: ModelInfo,
        weights: Mapping[str, Weight],
        dtype: torch.dtype,
        activation_dtype: torch.dtype,
        device: torch.device,
        projection: ProjectionFactory,
    ) -> None:
        """As `EncoderModel`'s: matrices in `dtype` through `projection`, embeddings and norms
        in `activation_dtype`, a classifier's head in float32."""
        self.info = info
        self.activation_dtype = activation_dtype
        prefix = "model." if "model.embeddings.tok_embeddings.weight" in weights else ""
        if f"{prefix}embeddings.tok_embeddings.weight" not in weights:
            raise ValueError(f"{info.name}: no ModernBERT weights (embeddings.tok_embeddings)")

        def take(name: str, as_dtype: torch.dtype = activation_dtype) -> Tensor | None:
            found = weights.get(name)
            return None if found is None else found.to(device=device, dtype=as_dtype).contiguous()  # type: ignore[union-attr]

        def norm(name: str, as_dtype: torch.dtype = activation_dtype) -> Norm:
            return take(f"{name}.weight", as_dtype), take(f"{name}.bias", as_dtype)  # type: ignore[return-value]

        def linear(name: str) -> Projection:
            return projection(take(f"{name}.weight", dtype), take(f"{name}.bias", dtype))  # type: ignore[arg-type]

        self.word = take(f"{prefix}embeddings.tok_embeddings.weight")
        self.embedding_norm = norm(f"{prefix}embeddings.norm")
        self.layers = [
            ModernBertLayer(
                attention_norm=norm(f"{layer}attn_norm") if i else None,
                qkv=linear(f"{layer}attn.Wqkv"),
                out=linear(f"{layer}attn.Wo"),
                mlp_norm=norm(f"{layer}mlp_norm"),
                up=linear(f"{layer}mlp.Wi"),
                down=linear(f"{layer}mlp.Wo"),
                window=info.window(i),
            )
            for i, layer in ((i, f"{prefix}layers.{i}.") for i in range(info.num_layers))
        ]
        self.final_norm = norm(f"{prefix}final_norm")
        self.act = ACTIVATIONS[info.hidden_act]
        self.pooling = info.pooling
        self.head = None
        if info.labels:  # dense, GELU, LayerNorm; the labels' layer
            dense, labels = norm("head.dense", torch.float32), norm("classifier", torch.float32)
            self.head = [*dense, *norm("head.norm", torch.float32), *labels]
        half = info.head_dim // 2
        self.frequencies = {
            theta: 1.0 / theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)
            for theta in (info.rope_theta, info.local_rope_theta)
        }

    def forward(self, input_ids: Tensor, positions: Tensor, batch: EncoderBatch) -> Tensor:
        """[tokens, hidden]: at each sequence's last token, its pooled state; elsewhere, each
        token's final state."""
        info = self.info
        hidden = self._norm(F.embedding(input_ids, self.word), self.embedding_norm)
        heads, head_dim = info.num_heads, info.head_dim
        seen = self._padding(batch)  # once a step, for every layer
        windows = {layer.window for layer in self.layers}
        masks = {w: self._window_masks(seen, positions, batch, w) for w in windows}
        turns = {  # each base's cos and sin of every token's position
            theta: _rotation(positions, frequencies)
            for theta, frequencies in self.frequencies.items()
        }
        for layer in self.layers:
            normed = (
                hidden if layer.attention_norm is None else self._norm(hidden, layer.attention_norm)
            )
            q, k, v = layer.qkv(normed).view(-1, 3, heads, head_dim).unbind(1)
            cos, sin = turns[info.local_rope_theta if layer.window else info.rope_theta]
            q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
            attended = self._attend(q, k, v, positions, batch, *masks[layer.window])
            hidden = layer.out(attended.reshape(-1, heads * head_dim), hidden)
            gate_input, gate = layer.up(self._norm(hidden, layer.mlp_norm)).chunk(2, dim=-1)
            hidden = layer.down(self.act(gate_input) * gate, hidden)
        hidden = self._norm(hidden, self.final_norm)
        hidden[batch.starts[1:] - 1] = self._pooled(hidden, batch)
        return hidden

    def _norm(self, x: Tensor, norm: Norm) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), *norm, self.info.layer_norm_eps)

    @staticmethod
    def _window_masks(
        seen: Tensor | None, positions: Tensor, batch: EncoderBatch, window: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """A layer's masks for `_attend`, once a step: where its window is shorter than the
        step's longest sequence, the positions within window // 2 of each other, joined to
        `seen` where the sequences are padded, else alone ([longest, longest]: a shorter
        sequence reads its corner)."""
        if not window or batch.longest <= window // 2:
            return seen, None
        at = torch.arange(batch.longest, device=positions.device)
        near = (at[:, None] - at[None, :]).abs() <= window // 2
        return (None, near) if seen is None else (seen & near, None)

    def pooled(self, last: Tensor) -> Tensor:
        """The vectors of the sequences' pooled states: a classifier's labels' logits."""
        if self.head is None:
            return last.float()
        dense, dense_bias, norm, norm_bias, labels, labels_bias = self.head
        shaped = F.gelu(F.linear(last.float(), dense, dense_bias))
        shaped = F.layer_norm(
            shaped, (shaped.shape[-1],), norm, norm_bias, self.info.layer_norm_eps
        )
        return F.linear(shaped, labels, labels_bias)


def _rotation(positions: Tensor, frequencies: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's [tokens, 1, head_dim / 2] cos and sin (float32)."""
    angles = positions.float()[:, None, None] * frequencies
    return angles.cos(), angles.sin()


def _rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on a head's two halves (transformers' rotate_half), computed in float32."""
    first, second = x.float().chunk(2, dim=-1)
    turned = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return turned.to(x.dtype)
