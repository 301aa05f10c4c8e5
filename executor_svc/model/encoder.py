"""An encoder-only transformer (BERT, RoBERTa, XLM-RoBERTa: `shared/encoder_support.py`). Every
token attends its whole sequence, so a step computes each prompt whole (the scheduler gives it
whole) and keeps no KV cache. Its answer is one vector a sequence: the final hidden states
pooled (CLS, mean or last, as the model's sentence-transformers config says), or a classifier's
labels' logits of its CLS state (BERT's pooler and classifier, RoBERTa's classification head:
each a tanh layer, then the labels' layer). Post-norm layers, as transformers computes them:
LayerNorm(x + attention(x)), then LayerNorm(x + MLP(x))."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnstile.executor_svc.model.layer_weights import Weight
from turnstile.executor_svc.model.projection import Projection, ProjectionFactory
from turnstile.shared.model_info import ModelInfo

Tensor = torch.Tensor
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Where a checkpoint keeps the encoder: a bare one's names have no prefix.
PREFIXES = ("bert.", "roberta.", "")


@dataclass(slots=True, frozen=True)
class EncoderBatch:
    """A step's sequences, each whole: each token's sequence, the sequences' offsets into the
    step's tokens (on the device, and known to the host), each token's type (a pair's second
    text: 1) where any has one."""

    rows: Tensor  # [tokens]
    starts: Tensor  # [sequences + 1]
    bounds: tuple[int, ...]  # the same offsets, on the host
    token_types: Tensor | None

    @property
    def longest(self) -> int:
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))


@dataclass(slots=True, frozen=True)
class EncoderLayer:
    qkv: Projection  # q, k and v stacked, with their biases
    out: Projection  # attention's output projection
    attention_norm: tuple[Tensor, Tensor]  # LayerNorm's weight and bias
    up: Projection
    down: Projection
    output_norm: tuple[Tensor, Tensor]


class EncoderModel:
    def __init__(
        self,
        info: ModelInfo,
        weights: Mapping[str, Weight],
        dtype: torch.dtype,
        activation_dtype: torch.dtype,
        device: torch.device,
        projection: ProjectionFactory,
    ) -> None:
        """Matrices and their biases in `dtype`, through the backend's `projection`; embeddings
        and norms in `activation_dtype`; a classifier's head in float32."""
        self.info = info
        self.activation_dtype = activation_dtype
        found = [p for p in PREFIXES if f"{p}embeddings.word_embeddings.weight" in weights]
        if not found:
            raise ValueError(f"{info.name}: no encoder weights (embeddings.word_embeddings)")
        prefix = found[0]

        def take(name: str, as_dtype: torch.dtype = activation_dtype) -> Tensor:
            return weights[name].to(device=device, dtype=as_dtype).contiguous()  # type: ignore[union-attr]

        def norm(name: str) -> tuple[Tensor, Tensor]:
            return take(f"{name}.weight"), take(f"{name}.bias")

        def linear(name: str) -> Projection:
            return projection(take(f"{name}.weight", dtype), take(f"{name}.bias", dtype))

        embeddings = prefix + "embeddings."
        self.word = take(embeddings + "word_embeddings.weight")
        self.position = take(embeddings + "position_embeddings.weight")
        types = embeddings + "token_type_embeddings.weight"
        self.types = take(types) if types in weights else None
        # One type (XLM-R): every token's, whatever types a request's pair asks for.
        self.one_type = self.types is None or self.types.shape[0] == 1
        self.embedding_norm = norm(embeddings + "LayerNorm")
        self.layers = []
        for i in range(info.num_layers):
            layer = f"{prefix}encoder.layer.{i}."
            attention = layer + "attention."
            qkv = [f"{attention}self.{p}" for p in ("query", "key", "value")]
            stacked = torch.cat([weights[f"{name}.weight"] for name in qkv])  # type: ignore[misc]
            bias = torch.cat([weights[f"{name}.bias"] for name in qkv])  # type: ignore[misc]
            self.layers.append(
                EncoderLayer(
                    qkv=projection(stacked.to(device=device, dtype=dtype).contiguous(),
                                   bias.to(device=device, dtype=dtype)),
                    out=linear(attention + "output.dense"),
                    attention_norm=norm(attention + "output.LayerNorm"),
                    up=linear(layer + "intermediate.dense"),
                    down=linear(layer + "output.dense"),
                    output_norm=norm(layer + "output.LayerNorm"),
                )
            )  # fmt: skip
        self.act = ACTIVATIONS[info.hidden_act]
        self.pooling = "cls" if info.labels else info.pooling  # a classifier's: its CLS
        self.head = self._head(weights, prefix, device) if info.labels else None

    @staticmethod
    def _head(weights: Mapping[str, Weight], prefix: str, device: torch.device) -> list[Tensor]:
        """A classifier's two layers, in float32: BERT's pooler and classifier, or RoBERTa's
        classification head's dense and out_proj (weight, bias each)."""
        if "classifier.out_proj.weight" in weights:
            names = ("classifier.dense", "classifier.out_proj")
        else:
            names = (prefix + "pooler.dense", "classifier")
        return [
            weights[f"{name}.{part}"].to(device=device, dtype=torch.float32)  # type: ignore[union-attr]
            for name in names
            for part in ("weight", "bias")
        ]

    def forward(self, input_ids: Tensor, positions: Tensor, batch: EncoderBatch) -> Tensor:
        """[tokens, hidden]: at each sequence's last token, its pooled state (a classifier's:
        its CLS state); elsewhere, each token's final state."""
        eps = self.info.layer_norm_eps
        hidden = F.embedding(input_ids, self.word)
        hidden = hidden + F.embedding(positions + self.info.position_offset, self.position)
        if self.types is not None:
            types = batch.token_types
            one = self.one_type or types is None
            hidden = hidden + (self.types[0] if one else F.embedding(types, self.types))
        hidden = F.layer_norm(hidden, (hidden.shape[-1],), *self.embedding_norm, eps)
        heads, head_dim = self.info.num_heads, self.info.head_dim
        seen = self._padding(batch)  # once a step, for every layer
        for layer in self.layers:
            q, k, v = layer.qkv(hidden).view(-1, 3, heads, head_dim).unbind(1)
            attended = self._attend(q, k, v, positions, batch, seen)
            attended = attended.reshape(-1, heads * head_dim)
            hidden = layer.out(attended, hidden)
            hidden = F.layer_norm(hidden, (hidden.shape[-1],), *layer.attention_norm, eps)
            hidden = layer.down(self.act(layer.up(hidden)), hidden)
            hidden = F.layer_norm(hidden, (hidden.shape[-1],), *layer.output_norm, eps)
        hidden[batch.starts[1:] - 1] = self._pooled(hidden, batch)
        return hidden

    @staticmethod
    def _padding(batch: EncoderBatch) -> Tensor | None:
        """Where the step's sequences are padded to the longest, which padded positions are
        each one's own ([sequences, 1, 1, longest]); None where attending one sequence at a
        time is cheaper: one sequence, or padding that would more than double the tokens (a
        long prompt beside short ones would pad them all to its length)."""
        count, longest = len(batch.bounds) - 1, batch.longest
        if count == 1 or count * longest > 2 * batch.bounds[-1]:
            return None
        lengths = batch.starts[1:] - batch.starts[:-1]
        seen = torch.arange(longest, device=batch.starts.device) < lengths[:, None]
        return seen[:, None, None, :]

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, batch: EncoderBatch,
                seen: Tensor | None, near: Tensor | None = None) -> Tensor:  # fmt: skip
        """Each sequence's tokens attending all of it: [tokens, heads, head_dim]; padded where
        `seen` says which positions each sequence's tokens see (`_padding`), else one at a
        time, each within `near` where given (a local layer's band of positions)."""
        if seen is None:
            out = torch.empty_like(q)
            for start, end in zip(batch.bounds, batch.bounds[1:], strict=False):
                one = (x[start:end].transpose(0, 1) for x in (q, k, v))
                band = None if near is None else near[: end - start, : end - start]
                attended = F.scaled_dot_product_attention(*one, attn_mask=band)
                out[start:end] = attended.transpose(0, 1)
            return out
        padded = q.new_zeros(3, seen.shape[0], seen.shape[-1], *q.shape[1:])
        padded[:, batch.rows, positions] = torch.stack((q, k, v))
        pq, pk, pv = padded.transpose(2, 3).unbind(0)  # [sequences, heads, longest, head_dim]
        out = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=seen)
        return out.transpose(1, 2)[batch.rows, positions]

    def _pooled(self, hidden: Tensor, batch: EncoderBatch) -> Tensor:
        """Each sequence's pooled state, as `self.pooling` says."""
        pooling = self.pooling
        if pooling == "cls":
            return hidden[batch.starts[:-1]]
        if pooling == "last":
            return hidden[batch.starts[1:] - 1]
        count = batch.starts.shape[0] - 1
        sums = hidden.new_zeros(count, hidden.shape[1]).index_add_(0, batch.rows, hidden)
        return sums / (batch.starts[1:] - batch.starts[:-1])[:, None]

    def pooled(self, last: Tensor) -> Tensor:
        """The vectors of the sequences' pooled states: a classifier's labels' logits."""
        if self.head is None:
            return last.float()
        dense, dense_bias, labels, labels_bias = self.head
        return F.linear(torch.tanh(F.linear(last.float(), dense, dense_bias)), labels, labels_bias)

    def logits(self, hidden: Tensor) -> Tensor:
        """An encoder has no language-model head: the token its requests sample (and drop) is
        always 0."""
        return hidden.new_zeros(hidden.shape[0], 1, dtype=torch.float32)
