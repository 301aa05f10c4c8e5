"""Sampling at the edges of its ranges behaves as vLLM's (never NaN, never an empty answer), and
a seed gives the same tokens alone or batched, with either noise source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnstile.executor_svc.sampler import (
    Noise,
    SamplingArrays,
    SamplingBatch,
    generator_noise,
    hashed_noise,
    sample,
)
from turnstile.executor_svc.staging import Staging
from turnstile.shared.protocol import SamplingParams

NOISES = pytest.mark.parametrize("noise", [generator_noise, hashed_noise])


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    noise: Noise,
    output_index: np.ndarray | None = None,
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The executor's path: host arrays, one upload, sampling, one copy back."""
    index = np.zeros(len(params), dtype=np.int64) if output_index is None else output_index
    arrays = SamplingArrays.build(params, index, np.random.default_rng(0))
    batch = SamplingBatch(arrays, Staging(torch.device("cpu")).upload(arrays.arrays()))
    tokens, logprobs = sample(logits.clone(), batch, lambda x: x.argmax(dim=-1), noise).to_host()
    return tokens.tolist(), logprobs


@NOISES
def test_a_vanishing_temperature_is_greedy_and_a_vanishing_top_p_keeps_the_top_token(
    noise: Noise,
) -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=4),
        SamplingParams(temperature=0.7, top_p=1e-300, top_k=5, logprobs=2),
    ]
    tokens, logprobs = run(logits, params, noise)
    assert tokens == greedy.tolist()
    assert logprobs[:3] == [[], [], []]
    (token, chosen), *top = logprobs[3]
    expected = logits[3].log_softmax(dim=-1).topk(2)
    assert token == tokens[3] and top[0][0] == token and np.isfinite(chosen)
    assert [t for t, _ in top] == expected.indices.tolist()
    np.testing.assert_allclose([v for _, v in top], expected.values.tolist(), rtol=1e-6)


@NOISES
def test_ordinary_temperatures_still_sample(noise: Noise) -> None:
    logits = torch.zeros(64, 50)  # uniform: greedy would always answer token 0
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]
    tokens, _ = run(logits, params, noise)
    assert len(set(tokens)) > 10


@NOISES
def test_a_seed_picks_the_same_tokens_alone_and_batched(noise: Noise) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    others = [SamplingParams(temperature=1.2), SamplingParams(), SamplingParams(temperature=0.5)]
    draws = []
    for step in range(5):  # each output index draws afresh
        alone, _ = run(logits[2:3], [seeded], noise, np.array([step]))
        batched, _ = run(logits[:4], [others[0], others[1], seeded, others[2]], noise,
                         np.array([9, 9, step, 9]))  # fmt: skip
        assert alone[0] == batched[2]
        draws.append(alone[0])
    assert len(set(draws)) > 1


def test_hashed_noise_is_exponential_and_keyed() -> None:
    keys = torch.tensor([1, 2, 2**62 + 5], dtype=torch.int64)
    noise = hashed_noise(keys, 200_000)
    assert torch.equal(noise, hashed_noise(keys, 200_000))
    assert noise.min() > 0 and torch.isfinite(noise).all()
    # Exp(1): mean 1 and variance 1, within a few standard errors for 200,000 draws a row.
    torch.testing.assert_close(noise.mean(dim=1), torch.ones(3), atol=0.01, rtol=0)
    torch.testing.assert_close(noise.var(dim=1), torch.ones(3), atol=0.03, rtol=0)
    assert not torch.equal(noise[0], noise[1])
