"""Sampling at the edges of its ranges behaves as vLLM's: never NaN, never an empty answer."""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.sampler import Sampler
from shared.protocol import SamplingParams


def test_a_vanishing_temperature_is_greedy_and_a_vanishing_top_p_keeps_the_top_token() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=4),
        SamplingParams(temperature=0.7, top_p=1e-300, top_k=5, logprobs=2),
    ]
    tokens, logprobs = Sampler().sample(logits, params, np.zeros(4, dtype=np.int64))
    assert tokens.tolist() == greedy.tolist()
    assert np.isfinite(logprobs[3][0][1])


def test_ordinary_temperatures_still_sample() -> None:
    logits = torch.zeros(64, 50)  # uniform: greedy would always answer token 0
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]
    tokens, _ = Sampler().sample(logits, params, np.zeros(64, dtype=np.int64))
    assert len(set(tokens.tolist())) > 10
