"""Sampling at the edges of its ranges behaves as vLLM's (never NaN, never an empty answer), and
a seed gives the same tokens alone or batched, with either race: torch's and the CPU's native
one, which draw the same tokens from the same seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnstile.executor_svc.sampler import (
    Race,
    SamplingArrays,
    SamplingBatch,
    hashed_race,
    hashed_uniform,
    row_seeds,
    sample,
)
from turnstile.executor_svc.staging import Staging
from turnstile.executor_svc.step_in_flight import HostCopy
from turnstile.kernels import cpu_native, native_sampling
from turnstile.shared.protocol import SamplingParams

native = pytest.mark.skipif(cpu_native.library() is None, reason="no AVX2 or no C compiler")
RACES = pytest.mark.parametrize(
    "race", [hashed_race, pytest.param(native_sampling.race, marks=native)]
)


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    race: Race,
    output_index: np.ndarray | None = None,
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The executor's path: host arrays, one upload, sampling, one copy back."""
    index = np.zeros(len(params), dtype=np.int64) if output_index is None else output_index
    arrays = SamplingArrays.build(params, index, np.random.default_rng(0))
    batch = SamplingBatch(arrays, Staging(torch.device("cpu")).upload(arrays.arrays()))
    drawn = sample(logits.clone(), batch, lambda x: x.argmax(dim=-1), race)
    tokens, logprobs = drawn.unpack(HostCopy(drawn.packed()).numpy())
    return tokens.tolist(), logprobs


@RACES
def test_a_vanishing_temperature_is_greedy_and_a_vanishing_top_p_keeps_the_top_token(
    race: Race,
) -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=4),
        SamplingParams(temperature=0.7, top_p=1e-300, top_k=5, logprobs=2),
    ]
    tokens, logprobs = run(logits, params, race)
    assert tokens == greedy.tolist()
    assert logprobs[:3] == [[], [], []]
    (token, chosen), *top = logprobs[3]
    expected = logits[3].log_softmax(dim=-1).topk(2)
    assert token == tokens[3] and top[0][0] == token and np.isfinite(chosen)
    assert [t for t, _ in top] == expected.indices.tolist()
    np.testing.assert_allclose([v for _, v in top], expected.values.tolist(), rtol=1e-6)


@RACES
def test_ordinary_temperatures_still_sample(race: Race) -> None:
    logits = torch.zeros(64, 50)  # uniform: greedy would always answer token 0
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]
    tokens, _ = run(logits, params, race)
    assert len(set(tokens)) > 10


@RACES
def test_a_seed_picks_the_same_tokens_alone_and_batched(race: Race) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    others = [SamplingParams(temperature=1.2), SamplingParams(), SamplingParams(temperature=0.5)]
    draws = []
    for step in range(5):  # each output index draws afresh
        alone, _ = run(logits[2:3], [seeded], race, np.array([step]))
        batched, _ = run(logits[:4], [others[0], others[1], seeded, others[2]], race,
                         np.array([9, 9, step, 9]))  # fmt: skip
        assert alone[0] == batched[2]
        draws.append(alone[0])
    assert len(set(draws)) > 1


def test_hashed_noise_is_exponential_and_keyed() -> None:
    seeds = torch.from_numpy(row_seeds(np.array([1, 2, 2**62 + 5])))
    noise = -torch.log(hashed_uniform(seeds, 200_000))
    assert torch.equal(noise, -torch.log(hashed_uniform(seeds, 200_000)))
    assert noise.min() > 0 and torch.isfinite(noise).all()
    # Exp(1): mean 1 and variance 1, within a few standard errors for 200,000 draws a row.
    torch.testing.assert_close(noise.mean(dim=1), torch.ones(3), atol=0.01, rtol=0)
    torch.testing.assert_close(noise.var(dim=1), torch.ones(3), atol=0.03, rtol=0)
    assert not torch.equal(noise[0], noise[1])


def _probabilities(rows: int, vocab: int) -> torch.Tensor:
    """Rows from flat to sharply peaked, some with tokens filtered out (probability 0)."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(0.1, 12, rows)[:, None]
    logits[::3, : vocab // 2] = -float("inf")
    return logits.softmax(dim=-1)


@native
@pytest.mark.parametrize("vocab", [1, 7, 300, 49_152, 128_257])
def test_the_native_race_draws_torchs_tokens(vocab: int) -> None:
    probs = _probabilities(64, vocab)
    seeds = torch.from_numpy(row_seeds(np.arange(64) * 7919))
    expected = hashed_race(probs, seeds)
    assert torch.equal(native_sampling.race(probs, seeds), expected)
    # A row's scale is no part of its draw: two routes to the same logits draw alike.
    assert torch.equal(native_sampling.race(probs * 0.5, seeds), expected)
    assert torch.equal(hashed_race(probs * 0.5, seeds), expected)


@RACES
def test_a_race_draws_each_token_as_often_as_its_probability(race: Race) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 1e-4]).expand(40_000, -1).contiguous()
    tokens = race(probs, torch.from_numpy(row_seeds(np.arange(40_000))))
    frequency = torch.bincount(tokens, minlength=6) / 40_000
    # Within four standard errors (at most 0.0025 here) of each probability; never token 4.
    torch.testing.assert_close(frequency, probs[0], atol=0.01, rtol=0)
    assert frequency[4] == 0


@pytest.mark.slow  # loads the embedded model, twice for each setting
def test_the_engines_seed_makes_unseeded_requests_draw_alike_across_starts() -> None:
    """vLLM's `--seed`: the same unseeded requests, in the same order, draw the same tokens at
    every start; without it, each start draws afresh."""
    from conftest import fixed_length_requests

    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.settings import build

    def draws(seed: int | None) -> list[list[int]]:
        engine = OfflineEngine(build(RunnerConfig, seed=seed, num_blocks=64))
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        requests = fixed_length_requests(prompts, SamplingParams(temperature=1.0), 16)
        return [result.token_ids for result in engine.generate(requests)]

    assert draws(7) == draws(7) != draws(8)
    assert draws(None) != draws(None)
