"""`turnstile bench sampler`: one step's random draw for many rows of a whole vocabulary, each
way a backend draws it: torch's hashed race (the CUDA backend's; here on the CPU) and the CPU's
native race, with the softmax that comes before either for scale."""

from __future__ import annotations

import numpy as np
import torch

from turnstile.bench.timing import median_ms
from turnstile.executor_svc.sampler import hashed_race, row_seeds
from turnstile.kernels import native_sampling


def measure(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of each draw over `repeats`, on the same logits and seeds."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits.softmax(dim=-1)
    seeds = torch.from_numpy(row_seeds(np.arange(rows)))
    return {
        "softmax": median_ms(lambda: logits.softmax(dim=-1), repeats),
        "torch hashed race": median_ms(lambda: hashed_race(probs, seeds), repeats),
        "native race": median_ms(lambda: native_sampling.race(probs, seeds), repeats),
    }
