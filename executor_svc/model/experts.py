"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5): a router picks each token's
top-k experts (`routers.py`), and the backend's experts (`Backend.experts`) run each token
through them. Here, in torch: every expert's tokens go through it in one grouped matmul a
projection (`F.grouped_mm`), not a loop per expert or per token. Grouping happens on the device
(a sort and a search), so a step never waits for the host to learn how many tokens each expert
got. The cpu backend's run on AMX-BF16 tiles: `backends/tiled_experts.py`."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from turnstile.executor_svc.model.projection import ProjectionFactory
from turnstile.executor_svc.model.routers import GroupedSigmoidRouter, Router, SoftmaxRouter
from turnstile.kernels.quantized_weights import QuantizedWeight
from turnstile.shared.model_info import ModelInfo


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's: gate clamped above at `limit`, up on both sides, (up + 1) gate sigmoid(alpha
    gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True, slots=True)
class Glu:
    """The gated activation between an expert's gate-up and down: act(gate) * up ("silu",
    "gelu_tanh"), or gpt-oss's "clamped_swiglu"."""

    kind: str
    alpha: float = 0.0
    limit: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamped_swiglu":
            return clamped_swiglu(gate, up, self.alpha, self.limit)
        return (F.silu(gate) if self.kind == "silu" else F.gelu(gate, approximate="tanh")) * up


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """A layer's experts as checkpoints store them: `gate_up` [experts, 2 * inner, hidden]
    (each expert's gate rows, then its up rows), `down` [experts, hidden, inner]; gpt-oss's
    biases [experts, 2 * inner] and [experts, hidden]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    glu: Glu
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BlockExpertWeights:
    """A layer's experts kept in their GGUF blocks, each expert's gate, up and down (the cpu
    backend multiplies them there: `backends/block_experts.py`); biases as `ExpertWeights`'."""

    gate: tuple[QuantizedWeight, ...]
    up: tuple[QuantizedWeight, ...]
    down: tuple[QuantizedWeight, ...]
    glu: Glu
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def dense(self, dtype: torch.dtype) -> ExpertWeights:
        """Their values, for a backend that computes on dense weights."""
        gate_up = [torch.cat((g.dequantize(dtype), u.dequantize(dtype)))
                   for g, u in zip(self.gate, self.up, strict=True)]  # fmt: skip
        down = torch.stack([d.dequantize(dtype) for d in self.down])
        return ExpertWeights(torch.stack(gate_up), down, self.glu, self.gate_up_bias,
                             self.down_bias)  # fmt: skip


class MixtureOfExperts(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        ...


# A backend's experts from a router and the weights (`Backend.experts`).
ExpertsFactory = Callable[[Router, ExpertWeights | BlockExpertWeights], MixtureOfExperts]


def load_experts(
    take: Callable[..., Any], names: Container[str], prefix: str, info: ModelInfo, rows: slice,
    activation_dtype: torch.dtype, glu: Glu, make: ExpertsFactory, projection: ProjectionFactory,
) -> MixtureOfExperts:  # fmt: skip
    """One layer's experts from the weights under `prefix` ("model.layers.N.mlp."), each
    expert's inner dimension cut to `rows` (this rank's share), the router in the
    activations' dtype, `glu` the dense MLP's (gpt-oss's own where its biases are), made by the
    backend's `make`, the router's logits by its `projection`; `take(name, as_dtype, rows=,
    cols=)` gives a weight on the device, and `names` are the weights stored (gpt-oss's biases
    among them)."""

    def tensor(name: str, *dtype: torch.dtype, **share: slice) -> torch.Tensor:
        weight = take(prefix + name, *dtype, **share)
        if isinstance(weight, QuantizedWeight):  # a router a GGUF file keeps in blocks
            return weight.dequantize(*dtype or (activation_dtype,))
        return weight

    experts = range(info.num_experts)

    def matrices(part: str, **share: slice) -> list[Any]:
        return [take(f"{prefix}experts.{e}.{part}_proj.weight", **share) for e in experts]

    gate, up = matrices("gate", rows=rows), matrices("up", rows=rows)
    down = matrices("down", cols=rows)
    blocks = all(isinstance(m, QuantizedWeight) for m in (*gate, *up, *down))
    if not blocks:  # a matrix in a format not kept: every one dense
        dtype = next(m.dtype for m in (*gate, *up, *down) if isinstance(m, torch.Tensor))
        gate, up, down = ([m.dequantize(dtype) if isinstance(m, QuantizedWeight) else m
                           for m in part] for part in (gate, up, down))  # fmt: skip
    top_k, normalize = info.experts_per_token, info.normalize_expert_weights
    if info.expert_groups:  # GLM-4.5's, in float32 as transformers keeps it
        logits = projection(tensor("gate.weight", torch.float32), None)
        correction = tensor("gate.e_score_correction_bias", torch.float32)
        groups = (info.expert_groups, info.kept_expert_groups)
        router: Router = GroupedSigmoidRouter(logits, correction, top_k, *groups, normalize,
                                              info.routed_scaling)  # fmt: skip
    else:
        bias = tensor("gate.bias", activation_dtype) if prefix + "gate.bias" in names else None
        logits = projection(tensor("gate.weight", activation_dtype), bias)
        router = SoftmaxRouter(logits, top_k, normalize)

    def weights(glu: Glu, *biases: torch.Tensor | None) -> ExpertWeights | BlockExpertWeights:
        if blocks:
            return BlockExpertWeights(tuple(gate), tuple(up), tuple(down), glu, *biases)
        gate_up = torch.stack([torch.cat(pair) for pair in zip(gate, up, strict=True)])
        return ExpertWeights(gate_up, torch.stack(down), glu, *biases)

    if prefix + "experts.0.gate_proj.bias" not in names:
        return make(router, weights(glu))
    gate_up_bias = [
        torch.cat([tensor(f"experts.{e}.{p}_proj.bias", rows=rows) for p in ("gate", "up")])
        for e in experts
    ]
    # down's bias where `names` hold it: on one rank only, as the ranks' outputs are summed
    down_bias = None
    if prefix + "experts.0.down_proj.bias" in names:
        down_bias = torch.stack([tensor(f"experts.{e}.down_proj.bias") for e in experts])
    swiglu = Glu("clamped_swiglu", info.swiglu_alpha, info.swiglu_limit)
    return make(router, weights(swiglu, torch.stack(gate_up_bias), down_bias))


class Experts:
    """In torch: each projection one grouped matmul over every expert's rows."""

    __slots__ = ("_experts", "biases", "down", "gate_up", "glu", "router")

    def __init__(self, router: Router, weights: ExpertWeights) -> None:
        """`router` picks each token's experts (`routers.py`)."""
        self.router = router
        # grouped_mm multiplies by [experts, in, out]: the stored matrices, transposed views.
        self.gate_up = weights.gate_up.transpose(1, 2)
        self.down = weights.down.transpose(1, 2)
        self.glu = weights.glu
        self.biases = (weights.gate_up_bias, weights.down_bias)
        self._experts = torch.arange(weights.gate_up.shape[0], device=weights.gate_up.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        gate_up_bias, down_bias = self.biases
        weights, chosen = self.router(x)
        top_k = chosen.shape[1]
        # Each (token, choice) pair a row, grouped by expert: group e ends at ends[e].
        experts, order = chosen.flatten().sort(stable=True)
        ends = torch.searchsorted(experts, self._experts, right=True).to(torch.int32)
        rows = x[order // top_k].to(self.gate_up.dtype)
        gate_up = F.grouped_mm(rows, self.gate_up, offs=ends)
        if gate_up_bias is not None:  # each row's expert's
            gate_up = gate_up + gate_up_bias[experts]
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.grouped_mm(self.glu(gate, up), self.down, offs=ends)
        if down_bias is not None:
            out = out + down_bias[experts]
        out = out.float() * weights.flatten()[order, None]
        summed = torch.empty_like(out).index_copy_(0, order, out)
        return summed.view(x.shape[0], top_k, -1).sum(dim=1).to(x.dtype)
