"""Sampling at the edges of its ranges behaves as vLLM's (never NaN, never an empty answer), a
seed gives the same tokens alone or batched, and the draws follow the probabilities."""

from __future__ import annotations

import numpy as np
import torch

from turnstile.executor_svc.sampler import SamplingArrays, SamplingBatch, draw, sample, uniforms
from turnstile.executor_svc.staging import Staging
from turnstile.shared.protocol import SamplingParams


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_index: np.ndarray | None = None,
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The executor's path: host arrays, one upload, sampling, one copy back."""
    index = np.zeros(len(params), dtype=np.int64) if output_index is None else output_index
    arrays = SamplingArrays.build(params, index, np.random.default_rng(0))
    batch = SamplingBatch(arrays, Staging(torch.device("cpu")).upload(arrays.arrays()))
    tokens, logprobs = sample(logits.clone(), batch, lambda x: x.argmax(dim=-1)).to_host()
    return tokens.tolist(), logprobs


def test_a_vanishing_temperature_is_greedy_and_a_vanishing_top_p_keeps_the_top_token() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=4),
        SamplingParams(temperature=0.7, top_p=1e-300, top_k=5, logprobs=2),
    ]
    tokens, logprobs = run(logits, params)
    assert tokens == greedy.tolist()
    assert logprobs[:3] == [[], [], []]
    (token, chosen), *top = logprobs[3]
    expected = logits[3].log_softmax(dim=-1).topk(2)
    assert token == tokens[3] and top[0][0] == token and np.isfinite(chosen)
    assert [t for t, _ in top] == expected.indices.tolist()
    np.testing.assert_allclose([v for _, v in top], expected.values.tolist(), rtol=1e-6)


def test_ordinary_temperatures_still_sample() -> None:
    logits = torch.zeros(64, 50)  # uniform: greedy would always answer token 0
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]
    tokens, _ = run(logits, params)
    assert len(set(tokens)) > 10


def test_a_seed_picks_the_same_tokens_alone_and_batched() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    others = [SamplingParams(temperature=1.2), SamplingParams(), SamplingParams(temperature=0.5)]
    draws = []
    for step in range(5):  # each output index draws afresh
        alone, _ = run(logits[2:3], [seeded], np.array([step]))
        batched, _ = run(logits[:4], [others[0], others[1], seeded, others[2]],
                         np.array([9, 9, step, 9]))  # fmt: skip
        assert alone[0] == batched[2]
        draws.append(alone[0])
    assert len(set(draws)) > 1


def test_uniforms_are_uniform_and_keyed() -> None:
    keys = torch.arange(200_000, dtype=torch.int64) * 1_000_003 + 2**62  # seeds' keys are close
    u = uniforms(keys)
    assert torch.equal(u, uniforms(keys)) and u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    # 10,000 a bin expected: a bin 5 standard deviations (500) off would fail.
    assert (counts - 10_000).abs().max() < 500, counts


def test_draws_follow_the_probabilities_and_never_pick_a_token_of_zero_mass() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    keys = torch.arange(100_000, dtype=torch.int64)
    tokens = draw(probs.expand(len(keys), -1), keys)
    frequency = torch.bincount(tokens, minlength=5) / len(keys)
    assert frequency[1] == 0 and frequency[3] == 0
    # Each frequency within 5 standard errors (at most 0.0016) of its probability.
    torch.testing.assert_close(frequency, probs, atol=0.008, rtol=0)
