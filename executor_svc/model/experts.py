"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's top-k
experts, and every expert's tokens go through it in one grouped matmul a projection
(`F.grouped_mm`), not a loop per expert or per token. Grouping happens on the device (a sort and
a search), so a step never waits for the host to learn how many tokens each expert got."""

from __future__ import annotations

from collections.abc import Callable, Container
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

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
    router = tensor("gate.weight", activation_dtype)
    if prefix + "experts.0.gate_proj.bias" not in names:
        return Experts(router, torch.stack(gate_up), torch.stack(down), info.experts_per_token,
                       info.normalize_expert_weights, lambda gate, up: act(gate) * up)  # fmt: skip
    gate_up_bias = [
        torch.cat([tensor(f"experts.{e}.{p}_proj.bias", rows=rows) for p in ("gate", "up")])
        for e in experts
    ]
    # down's bias where `names` hold it: on one rank only, as the ranks' outputs are summed
    down_bias = None
    if prefix + "experts.0.down_proj.bias" in names:
        down_bias = torch.stack([tensor(f"experts.{e}.down_proj.bias") for e in experts])
    glu = partial(clamped_swiglu, alpha=info.swiglu_alpha, limit=info.swiglu_limit)
    biases = (tensor("gate.bias", activation_dtype), torch.stack(gate_up_bias), down_bias)
    return Experts(router, torch.stack(gate_up), torch.stack(down), info.experts_per_token,
                   info.normalize_expert_weights, glu, *biases)  # fmt: skip


class Experts:
    __slots__ = ("_experts", "_glu", "biases", "down", "gate_up", "normalize", "router", "top_k")

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        normalize: bool,
        glu: Gated,
        router_bias: torch.Tensor | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """`router` [experts, hidden], in the activations' dtype; `gate_up` [experts, 2 *
        inner, hidden] (each expert's gate rows, then its up rows); `down` [experts, hidden,
        inner]: as checkpoints store them. `normalize`: the top-k weights scaled to sum to 1
        (Mixtral, gpt-oss; Qwen3-MoE's `norm_topk_prob`). `glu(gate, up)`: SiLU(gate) * up,
        or gpt-oss's. gpt-oss's biases: the router's [experts], each expert's gate-up [experts,
        2 * inner] and down [experts, hidden]."""
        self.router = router
        # grouped_mm multiplies by [experts, in, out]: the stored matrices, transposed views.
        self.gate_up = gate_up.transpose(1, 2)
        self.down = down.transpose(1, 2)
        self.top_k = top_k
        self.normalize = normalize
        self._glu = glu
        self.biases = (router_bias, gate_up_bias, down_bias)
        self._experts = torch.arange(router.shape[0], device=router.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        # The router's probabilities in float32, as transformers computes them.
        router_bias, gate_up_bias, down_bias = self.biases
        probs = F.linear(x, self.router, router_bias).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Each (token, choice) pair a row, grouped by expert: group e ends at ends[e].
        experts, order = chosen.flatten().sort(stable=True)
        ends = torch.searchsorted(experts, self._experts, right=True).to(torch.int32)
        rows = x[order // self.top_k].to(self.gate_up.dtype)
        gate_up = F.grouped_mm(rows, self.gate_up, offs=ends)
        if gate_up_bias is not None:  # each row's expert's
            gate_up = gate_up + gate_up_bias[experts]
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.grouped_mm(self._glu(gate, up), self.down, offs=ends)
        if down_bias is not None:
            out = out + down_bias[experts]
        out = out.float() * weights.flatten()[order, None]
        summed = torch.empty_like(out).index_copy_(0, order, out)
        return summed.view(x.shape[0], self.top_k, -1).sum(dim=1).to(x.dtype)
