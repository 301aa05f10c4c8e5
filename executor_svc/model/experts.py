"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
and every expert's tokens go through it in one grouped matmul a projection (`F.grouped_mm`),
not a loop per expert or per token. Grouping happens on the device (a sort and a search), so a
step never waits for the host to learn how many tokens each expert got."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from turnstile.shared.model_info import ModelInfo

Activation = Callable[[torch.Tensor], torch.Tensor]


def load_experts(
    take: Callable[..., Any], prefix: str, info: ModelInfo, rows: slice, act: Activation,
    activation_dtype: torch.dtype,
) -> Experts:  # fmt: skip
    """One layer's experts from the weights under `prefix` ("model.layers.N.mlp."), each
    expert's inner dimension cut to `rows` (this rank's share), the router in the
    activations' dtype; `take(name, as_dtype, rows=, cols=)` gives a weight on the device."""

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
    return Experts(tensor("gate.weight", activation_dtype), torch.stack(gate_up), torch.stack(down),
                   info.experts_per_token, info.normalize_expert_weights, act)  # fmt: skip


class Experts:
    __slots__ = ("_act", "_experts", "down", "gate_up", "normalize", "router", "top_k")

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        normalize: bool,
        act: Activation,
    ) -> None:
        """`router` [experts, hidden], in the activations' dtype; `gate_up` [experts, 2 *
        inner, hidden] (each expert's gate rows, then its up rows); `down` [experts, hidden,
        inner]: as checkpoints store them. `normalize`: the top-k weights scaled to sum to 1
        (Mixtral; Qwen3-MoE's `norm_topk_prob`)."""
        self.router = router
        # grouped_mm multiplies by [experts, in, out]: the stored matrices, transposed views.
        self.gate_up = gate_up.transpose(1, 2)
        self.down = down.transpose(1, 2)
        self.top_k = top_k
        self.normalize = normalize
        self._act = act
        self._experts = torch.arange(router.shape[0], device=router.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        # The router's probabilities in float32, as transformers computes them.
        probs = F.linear(x, self.router).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Each (token, choice) pair a row, grouped by expert: group e ends at ends[e].
        experts, order = chosen.flatten().sort(stable=True)
        ends = torch.searchsorted(experts, self._experts, right=True).to(torch.int32)
        rows = x[order // self.top_k].to(self.gate_up.dtype)
        gate, up = F.grouped_mm(rows, self.gate_up, offs=ends).chunk(2, dim=-1)
        out = F.grouped_mm(self._act(gate) * up, self.down, offs=ends)
        out = out.float() * weights.flatten()[order, None]
        summed = torch.empty_like(out).index_copy_(0, order, out)
        return summed.view(x.shape[0], self.top_k, -1).sum(dim=1).to(x.dtype)
