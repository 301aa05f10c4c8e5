"""The requests' logits adjustments (penalties, logit_bias, allowed_token_ids, bad_words,
min_tokens, min_p), batched on the device, against a row-by-row reading of vLLM's definitions;
and a seeded row picks the same tokens alone or batched with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnstile.executor_svc.logits_adjustments import (
    History,
    LogitsAdjustments,
    adjust,
    mask_by_grammar,
)
from turnstile.executor_svc.sampler import SamplingArrays, SamplingBatch, hashed_race, sample
from turnstile.executor_svc.staging import Staging
from turnstile.executor_svc.step_in_flight import HostCopy
from turnstile.shared.protocol import SamplingParams

VOCAB = 50


def history_of(rows: list[tuple[list[int], list[int]]]) -> History:
    return lambda row: (np.array(rows[row][0], dtype=np.int64), np.array(rows[row][1]))


def adjusted(logits: torch.Tensor, params: list[SamplingParams], histories: list) -> torch.Tensor:
    index = np.array([len(generated) for _, generated in histories], dtype=np.int64)
    host = LogitsAdjustments.build(params, index, history_of(histories))
    out = logits.clone()
    adjust(out, Staging(torch.device("cpu")).upload(host.arrays))
    return out


def reference(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """One row, written as vLLM's sampler documents each step, in its order."""
    row = logits.clone()
    if p.allowed_token_ids:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        row[~keep] = -float("inf")
    for word in p.bad_words:
        if len(word) == 1 or generated[-(len(word) - 1) :] == word[:-1]:
            row[word[-1]] = -float("inf")
    if len(generated) < p.min_tokens:
        row[p.min_tokens_stop_ids] = -float("inf")
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(generated):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else (
            row[token] * p.repetition_penalty)  # fmt: skip
    for token in set(generated):
        row[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return row


def test_batched_adjustments_equal_the_row_by_row_definitions() -> None:
    rng = np.random.default_rng(0)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(),  # untouched in the middle of the batch
        SamplingParams(logit_bias=[(3, -100.0), (7, 5.5), (3, 1.0)], repetition_penalty=0.8),
        SamplingParams(allowed_token_ids=[1, 4, 9, 16], frequency_penalty=2.0),
        SamplingParams(
            bad_words=[[5], [11, 12], [30, 31, 32]], min_tokens=9, min_tokens_stop_ids=[0, 2]
        ),
        SamplingParams(presence_penalty=1.5, bad_words=[[11, 12]]),
    ]
    histories = [
        (rng.integers(0, VOCAB, 20).tolist(), rng.integers(0, VOCAB, 15).tolist()),
        ([1, 2], [3]),
        ([3, 3, 8], [7, 7, 7]),
        ([1], [4, 4, 9, 20]),
        ([2], [1, 30, 31]),  # ends in 30 31: 32 is banned, 12 is not
        ([9], [11]),  # ends in 11: 12 is banned
    ]
    ours = adjusted(logits, params, histories)
    for row, (p, (prompt, generated)) in enumerate(zip(params, histories, strict=True)):
        torch.testing.assert_close(ours[row], reference(logits[row], p, prompt, generated))
    assert ours[4, 32] == -float("inf") and torch.isfinite(ours[4, 12])
    assert ours[5, 12] == -float("inf")


def sampled(logits: torch.Tensor, params: list[SamplingParams], histories: list) -> list[int]:
    index = np.array([len(generated) for _, generated in histories], dtype=np.int64)
    arrays = SamplingArrays.build(params, index, np.random.default_rng(0), history_of(histories))
    batch = SamplingBatch(arrays, Staging(torch.device("cpu")).upload(arrays.arrays()))
    drawn = sample(logits.clone(), batch, lambda x: x.argmax(dim=-1), hashed_race)
    tokens, _ = drawn.unpack(HostCopy(drawn.packed()).numpy())
    return tokens.tolist()


def test_a_bias_of_minus_100_removes_the_greedy_token_and_allowed_ids_bound_the_choice() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    greedy = int(logits.argmax())
    no_history = [([1], [])]
    assert sampled(logits, [SamplingParams(logit_bias=[(greedy, -100.0)])], no_history) != [greedy]
    allowed = [5, 6, 7]
    for seed in range(20):
        params = SamplingParams(temperature=1.5, seed=seed, allowed_token_ids=allowed)
        drawn = sampled(logits, [params], no_history)
        assert drawn[0] in allowed


def test_min_p_draws_only_tokens_near_the_top() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0] + [-9.0] * (VOCAB - 4)])
    draws = {
        sampled(logits, [SamplingParams(temperature=1.0, min_p=0.5, seed=s)], [([1], [])])[0]
        for s in range(40)
    }
    assert draws == {0, 1}  # the others are below half the top token's probability


@pytest.mark.parametrize("batched_with", [0, 3])
def test_a_seeded_row_with_adjustments_is_the_same_alone_or_batched(batched_with: int) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=0.9, seed=5, min_p=0.05, frequency_penalty=0.5,
                            logit_bias=[(1, 2.0)], bad_words=[[4]])  # fmt: skip
    others = [SamplingParams(presence_penalty=1.0), SamplingParams(temperature=1.0),
              SamplingParams(allowed_token_ids=[1, 2])][:batched_with]  # fmt: skip
    history = ([1, 2, 3], [7, 7, 8])
    alone = sampled(logits[:1], [seeded], [history])[0]
    together = sampled(logits[: 1 + len(others)], [seeded, *others],
                       [history] + [([2], [3])] * len(others))  # fmt: skip
    assert together[0] == alone


def test_a_grammar_bitmask_masks_exactly_the_tokens_whose_bits_are_clear() -> None:
    vocab, generator = 100, torch.Generator().manual_seed(5)
    logits = torch.randn(5, vocab, generator=generator)
    rows = torch.tensor([3, 0, 4])
    words = torch.randint(-(2**31), 2**31, (3, 4), generator=generator)  # int32 values
    masked = logits.clone()
    mask_by_grammar(masked, rows, words)
    expected = logits.clone()
    for k, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(words[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = -float("inf")
    assert torch.equal(masked, expected)
