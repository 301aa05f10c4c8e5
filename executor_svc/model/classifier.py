"""A sequence classifier's head, on its last token's final hidden state: the checkpoint's
`score` layer, or (vLLM's `classifier_from_token`: Qwen3-Reranker served as a classifier) rows of
its language-model head: the second token's less the first's ("from_2_way_softmax": its sigmoid
is the softmax of the two tokens' logits), or each token's row a label."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from turnstile.shared.model_info import ModelInfo


def classifier_head(
    info: ModelInfo, weights: Mapping[str, Any], device: torch.device
) -> list[torch.Tensor] | None:
    """The head's weight (labels x hidden) and bias where it has one, in float32; None for a
    language model. Every rank keeps all of it."""
    if not info.labels:
        return None
    if not info.classifier_tokens:
        if "score.weight" not in weights:
            raise ValueError(f"{info.name}: a sequence classifier without its head "
                             "(score.weight): --convert classify needs one")  # fmt: skip
        names = [name for name in ("score.weight", "score.bias") if name in weights]
        return [weights[name].to(device=device, dtype=torch.float32) for name in names]
    tied = "lm_head.weight" not in weights
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    rows = head[list(info.classifier_tokens)].to(device=device, dtype=torch.float32)
    return [rows[1:] - rows[:1] if info.classifier_method == "from_2_way_softmax" else rows]
