"""How a mixture of experts picks each token's experts and weighs them, as transformers computes
it in float32: a softmax over the experts (Mixtral, Qwen3-MoE, gpt-oss), or DeepSeek-V3's
sigmoid scores chosen within the best groups of experts (GLM-4.5). Each router gives, for rows
`x` [tokens, hidden], each token's top-k weights and experts, both [tokens, top_k]. The
router's logits are the backend's projection (`Backend.projection`): on the cpu backend the
native kernel's, whose row's bits do not depend on the rows beside it, as torch's `F.linear`'s
do, so a token picks the same experts alone or batched."""

from __future__ import annotations

import torch

from turnstile.executor_svc.model.projection import Projection


class SoftmaxRouter:
    __slots__ = ("logits", "normalize", "top_k")

    def __init__(self, logits: Projection, top_k: int, normalize: bool) -> None:
        """`logits`: the projection by the gate's [experts, hidden] weight in the activations'
        dtype, with gpt-oss's bias; `normalize`: the top-k weights scaled to sum to 1 (Mixtral
        and gpt-oss, whose softmax of the top-k logits is that; Qwen3-MoE's
        `norm_topk_prob`)."""
        self.logits, self.top_k, self.normalize = logits, top_k, normalize

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.logits(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen


class GroupedSigmoidRouter:
    __slots__ = ("correction", "groups", "kept_groups", "logits", "normalize", "scale", "top_k")

    def __init__(
        self, logits: Projection, correction: torch.Tensor, top_k: int, groups: int,
        kept_groups: int, normalize: bool, scale: float,
    ) -> None:  # fmt: skip
        """`logits`: the projection by the gate's [experts, hidden] weight in float32, of
        float32 rows; each expert's score its logit's sigmoid;
        `correction` [experts] added to the scores only to choose (`e_score_correction_bias`);
        the experts in `groups` groups, each scored by its two best, and the top-k chosen
        within the best `kept_groups`; the chosen scores normalized where `normalize`, then
        times `scale` (`routed_scaling_factor`)."""
        self.logits, self.correction, self.top_k = logits, correction, top_k
        self.groups, self.kept_groups = groups, kept_groups
        self.normalize, self.scale = normalize, scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.logits(x.float()).sigmoid()
        choice = scores + self.correction
        if self.groups > 1:
            grouped = choice.view(x.shape[0], self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.kept_groups, dim=-1)
            kept = torch.zeros(x.shape[0], self.groups, dtype=torch.bool, device=x.device)
            kept.scatter_(1, best.indices, True)
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).view_as(choice)
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, chosen


Router = SoftmaxRouter | GroupedSigmoidRouter
