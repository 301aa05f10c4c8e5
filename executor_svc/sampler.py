"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, top-N logprobs.

A seeded request draws its noise from a generator keyed by (seed, output index), so it picks
the same tokens alone or in any batch, and again after a preemption.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cpu_native import argmax
from shared.protocol import SamplingParams

_SEED_STRIDE = 1_000_003
# Below this a temperature is greedy, as in vLLM: dividing by it overflows the logits to inf.
MIN_TEMPERATURE = 1e-5


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (in place) the tokens outside each row's top-k and top-p sets."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, -float("inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p, and always the first token (a top_p
    # that rounds to 0 in float32 would otherwise cut every token).
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    cut[:, 0] = False
    logits.scatter_(-1, order, sorted_logits.masked_fill(cut, -float("inf")))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._unseeded = torch.Generator().manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: np.ndarray
    ) -> tuple[torch.Tensor, list[list[tuple[int, float]]]]:
        """Tokens for each row of float32 `logits`; `output_index[i]` is how many tokens row i
        generated before this one. Returns the tokens and, per row, [(sampled token, its
        logprob), then the top N] when that row asked for N logprobs, else []."""
        tokens = argmax(logits)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
        if random_rows:
            rows = torch.tensor(random_rows)
            chosen = [params[i] for i in random_rows]
            scaled = logits[rows] / torch.tensor([p.temperature for p in chosen])[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 for p in chosen):
                _filter_top_k_top_p(
                    scaled,
                    torch.tensor([p.top_k for p in chosen]),
                    torch.tensor([p.top_p for p in chosen]),
                )
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for row, (i, p) in enumerate(zip(random_rows, chosen, strict=True)):
                generator = self._unseeded
                if p.seed is not None:
                    key = (p.seed * _SEED_STRIDE + int(output_index[i])) % (2**63)
                    generator = torch.Generator().manual_seed(key)
                noise[row].exponential_(generator=generator)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens, self._logprobs(logits, tokens, params)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> list[list[tuple[int, float]]]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[list[tuple[int, float]]] = [[] for _ in params]
        if not wanted:
            return result
        rows = torch.tensor(wanted)
        logprobs = logits[rows].log_softmax(dim=-1)
        top = max(params[i].logprobs or 0 for i in wanted)
        top_values, top_ids = logprobs.topk(top, dim=-1)
        sampled = logprobs.gather(1, tokens[rows][:, None]).squeeze(1)
        for row, i in enumerate(wanted):
            n = params[i].logprobs
            top_n = zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)
            result[i] = [(int(tokens[i]), float(sampled[row])), *top_n]
        return result
