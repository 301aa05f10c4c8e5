"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5): a router picks each token's
top-k experts (`routers.py`), and every expert's tokens go through it in one grouped matmul a
projection (`F.grouped_mm`), not a loop per expert or per token. Grouping happens on the device
(a sort and a search), so a step never waits for the host to learn how many tokens each expert
got."""

from __future__ import annotations

from collections.abc import Callable, Container
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from turnstile.executor_svc.model.routers import GroupedSigmoidRouter, Router, SoftmaxRouter
from turnstile.shared.model_info import ModelInfo

Activation = Callable[[torch.Tensor], torch.Tensor]
Gated = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the down's input


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's: gate clamped above at `limit`, up on both sides, (up + 1) gate sigmoid(alpha
    gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def load_experts(
    take: Callable[..., Any], names: Container[str], prefix: str, info: ModelInfo, rows: slice,
    act: Activation, activation_dtype: torch.dtype,
) -> Experts:  # fmt: skip
    """One layer's experts from the weights under `prefix` ("model.layers.N.mlp."), each
    expert's inner dimension cut to `rows` (this rank's share), the router in the
    activations' dtype; `take(name, as_dtype, rows=, cols=)` gives a weight on the device, and
    `names` are the weights stored (gpt-oss's biases among them)."""

    def tensor(name: str, *dtype: torch.dtype, **share: slice) -> torch.Tensor:
        weight = take(prefix + name, *dtype, **share)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{prefix + name}: quantized experts are not implemented")
        return weight

    experts = range(info.num_experts)
    gate_up = [
        torch.cat([tensor(f"experts.{e}.{p}_proj.weight", rows=rows) for p in ("gate", "up")])
        for e in experts
    ]
    down = [tensor(f"experts.{e}.down_proj.weight", cols=rows) for e in experts]
    top_k, normalize = info.experts_per_token, info.normalize_expert_weights
    if info.expert_groups:  # GLM-4.5's, in float32 as transformers keeps it
        router: Router = GroupedSigmoidRouter(
            tensor("gate.weight", torch.float32), tensor("gate.e_score_correction_bias",
            torch.float32), top_k, info.expert_groups, info.kept_expert_groups, normalize,
            info.routed_scaling,
        )  # fmt: skip
    else:
        bias = tensor("gate.bias", activation_dtype) if prefix + "gate.bias" in names else None
        router = SoftmaxRouter(tensor("gate.weight", activation_dtype), bias, top_k, normalize)
    if prefix + "experts.0.gate_proj.bias" not in names:
        return Experts(router, torch.stack(gate_up), torch.stack(down),
                       lambda gate, up: act(gate) * up)  # fmt: skip
    gate_up_bias = [
        torch.cat([tensor(f"experts.{e}.{p}_proj.bias", rows=rows) for p in ("gate", "up")])
        for e in experts
    ]
    # down's bias where `names` hold it: on one rank only, as the ranks' outputs are summed
    down_bias = None
    if prefix + "experts.0.down_proj.bias" in names:
        down_bias = torch.stack([tensor(f"experts.{e}.down_proj.bias") for e in experts])
    glu = partial(clamped_swiglu, alpha=info.swiglu_alpha, limit=info.swiglu_limit)
    return Experts(router, torch.stack(gate_up), torch.stack(down), glu, torch.stack(gate_up_bias),
                   down_bias)  # fmt: skip


class Experts:
    __slots__ = ("_experts", "_glu", "biases", "down", "gate_up", "router")

    def __init__(
        self,
        router: Router,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        glu: Gated,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """`router` picks each token's experts (`routers.py`); `gate_up` [experts, 2 * inner,
        hidden] (each expert's gate rows, then its up rows); `down` [experts, hidden, inner]: as
        checkpoints store them. `glu(gate, up)`: SiLU(gate) * up, or gpt-oss's. gpt-oss's
        biases: each expert's gate-up [experts, 2 * inner] and down [experts, hidden]."""
        self.router = router
        # grouped_mm multiplies by [experts, in, out]: the stored matrices, transposed views.
        self.gate_up = gate_up.transpose(1, 2)
        self.down = down.transpose(1, 2)
        self._glu = glu
        self.biases = (gate_up_bias, down_bias)
        self._experts = torch.arange(gate_up.shape[0], device=gate_up.device)

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
        out = F.grouped_mm(self._glu(gate, up), self.down, offs=ends)
        if down_bias is not None:
            out = out + down_bias[experts]
        out = out.float() * weights.flatten()[order, None]
        summed = torch.empty_like(out).index_copy_(0, order, out)
        return summed.view(x.shape[0], top_k, -1).sum(dim=1).to(x.dtype)
