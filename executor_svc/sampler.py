"""Token selection on the step's device: the grammars' masks, the requests' logits
adjustments, greedy, temperature, min-p, top-k, top-p, per-request seeds, top-N logprobs (of
the raw logits, as vLLM's default).

The host turns the rows' parameters into arrays once a step (`SamplingArrays`); they travel to
the device with the step's other inputs, and `sample` runs there with no host sync. Each
sampling row races its tokens with noise hashed from a seed: for a seeded request, a hash of
(seed, output index), so it picks the same tokens alone or in any batch, and again after a
preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from turnstile.executor_svc.logits_adjustments import (
    History,
    LogitsAdjustments,
    adjust,
    mask_by_grammar,
)
from turnstile.executor_svc.prompt_logprobs import PromptPositions
from turnstile.shared.protocol import SamplingParams

_SEED_STRIDE = 1_000_003
# Below this a temperature is greedy, as in vLLM: dividing by it overflows the logits to inf.
MIN_TEMPERATURE = 1e-5

# (probabilities [rows, vocab], seeds [rows]) -> the tokens winning `hashed_race`'s race [rows]
Race = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Logprobs = list[list[tuple[int, float]]]


@dataclass(slots=True)
class SamplingArrays:
    """One step's sampling parameters on the host, per sampling row. Random rows are those
    with a temperature; `None` where no row needs that part."""

    random_rows: np.ndarray | None  # indices of the random rows among the sampling rows
    temperature: np.ndarray  # float64, per random row
    top_k: np.ndarray  # per random row, 0: off
    top_p: np.ndarray  # float64, per random row
    seeds: np.ndarray  # per random row, below 2**32: its noise's
    filters: bool  # whether any random row has top-k or top-p
    min_p: np.ndarray | None  # per random row, where any has one
    logprob_rows: np.ndarray | None  # rows that asked for logprobs
    top_logprobs: list[int]  # how many top entries each of them asked for
    adjustments: LogitsAdjustments
    embed_rows: np.ndarray | None  # rows whose last prompt token's hidden state is asked for
    prompt: PromptPositions | None = None  # prompt tokens whose logprobs are asked for

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_index: np.ndarray,
        rng: np.random.Generator,
        history: History | None = None,
        adjusting: np.ndarray | None = None,
    ) -> SamplingArrays:
        """`output_index[i]`: how many tokens row i generated before this one; `history(i)`
        its tokens, for the adjustments that read them (penalties, bad words); `adjusting`:
        the rows with adjustments, where the caller knows them (else every row is looked at)."""
        random = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
        chosen = [params[i] for i in random]
        keys = rng.integers(0, 2**63, len(random), dtype=np.int64)
        for row, (i, p) in enumerate(zip(random, chosen, strict=True)):
            if p.seed is not None:
                keys[row] = (p.seed * _SEED_STRIDE + int(output_index[i])) % (2**63)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        embed = [i for i, p in enumerate(params) if p.embed and output_index[i] == 0]
        return cls(
            random_rows=np.array(random, dtype=np.int64) if random else None,
            temperature=np.array([p.temperature for p in chosen], dtype=np.float64),
            top_k=np.array([p.top_k for p in chosen], dtype=np.int64),
            top_p=np.array([p.top_p for p in chosen], dtype=np.float64),
            seeds=row_seeds(keys),
            filters=any(p.top_k > 0 or p.top_p < 1.0 for p in chosen),
            min_p=np.array([p.min_p for p in chosen]) if any(p.min_p for p in chosen) else None,
            logprob_rows=np.array(wanted, dtype=np.int64) if wanted else None,
            top_logprobs=[params[i].logprobs or 0 for i in wanted],
            adjustments=LogitsAdjustments.build(
                params, output_index, history or _no_history, adjusting
            ),
            embed_rows=np.array(embed, dtype=np.int64) if embed else None,
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """What the device needs, for the step's one upload."""
        out = {}
        if self.random_rows is not None:
            out = {
                "random_rows": self.random_rows,
                "temperature": self.temperature,
                "seeds": self.seeds,
            }
            if self.filters:
                out |= {"top_k": self.top_k, "top_p": self.top_p}
            if self.min_p is not None:
                out["min_p"] = self.min_p
        if self.logprob_rows is not None:
            out["logprob_rows"] = self.logprob_rows
        if self.embed_rows is not None:
            out["embed_rows"] = self.embed_rows
        if self.prompt is not None:
            out |= self.prompt.arrays()
        return out | self.adjustments.arrays


def _no_history(row: int) -> tuple[np.ndarray, np.ndarray]:
    raise ValueError("a row's penalties or bad words need its tokens; none were given")


@dataclass(slots=True)
class SamplingBatch:
    """`SamplingArrays` on the device (`device` holds what `arrays()` uploaded)."""

    host: SamplingArrays
    device: dict[str, torch.Tensor]


@dataclass(slots=True)
class Sampled:
    """The step's tokens on the device, and the logprobs asked for."""

    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # per asking row, float64: sampled, top N ids, top N values
    asking: list[tuple[int, int]]  # (row, N) for each row of `logprobs`

    def packed(self) -> torch.Tensor:
        """What the host needs, as one tensor for one device-to-host copy: the tokens, then
        the logprobs when asked for (float64: ids below 2**53 are exact)."""
        if self.logprobs is None:
            return self.tokens
        return torch.cat((self.tokens.double(), self.logprobs.reshape(-1)))

    def unpack(self, both: np.ndarray) -> tuple[np.ndarray, Logprobs]:
        """The host's copy of `packed()`: the tokens, and per row [(token, its logprob), top
        N...] where asked for."""
        rows = self.tokens.shape[0]
        result: Logprobs = [[] for _ in range(rows)]
        if self.logprobs is None:
            return both.astype(np.int64, copy=False), result
        tokens = both[:rows].astype(np.int64)
        table = both[rows:].reshape(len(self.asking), -1)
        width = (table.shape[1] - 1) // 2
        for entry, (row, n) in zip(table, self.asking, strict=True):
            ids = entry[1 : 1 + n].astype(np.int64).tolist()
            top = zip(ids, entry[1 + width : 1 + width + n].tolist(), strict=True)
            result[row] = [(int(tokens[row]), float(entry[0])), *top]
        return tokens, result


# splitmix64's constants, and murmur3's finalizer's with Knuth's 32-bit golden ratio.
_GOLDEN, _MIX = 0x9E3779B97F4A7C15, (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_GOLDEN32, _MIX32 = 0x9E3779B9, (0x85EBCA6B, 0xC2B2AE35)
_LOW32 = 0xFFFFFFFF


def row_seeds(keys: np.ndarray) -> np.ndarray:
    """A 32-bit seed for each row's noise: splitmix64 of its int64 key, on the host."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64) + np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX[0])
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX[1])
        x ^= x >> np.uint64(31)
    return (x & np.uint64(_LOW32)).astype(np.int64)


def hashed_uniform(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 inside (0, 1), hashed from (seed, token) by murmur3's finalizer
    in int64 (masked to 32 bits), all rows in a few elementwise ops on the device: nothing a
    CUDA graph or a fake tensor cannot follow. race.c hashes the same bits."""
    x = (seeds[:, None] + torch.arange(1, vocab + 1, device=seeds.device) * _GOLDEN32) & _LOW32
    x = ((x ^ (x >> 16)) * _MIX32[0]) & _LOW32
    x = ((x ^ (x >> 13)) * _MIX32[1]) & _LOW32
    x = x ^ (x >> 16)
    return ((x >> 9).float() + 0.5) * 2.0**-23  # 23 bits and a half: never 0 or 1


def hashed_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn by an exponential race: argmax p / E with E = -log(u) Exp(1).
    A global factor on a row's probabilities changes nothing, and a last-bit change of one
    only where it ties with the winner: two routes to the logits draw the same tokens."""
    return (probs / -torch.log(hashed_uniform(seeds, probs.shape[-1]))).argmax(dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (in place) the tokens outside each row's top-k and top-p sets."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, -float("inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p, and always the first token (a top_p
    # that rounds to 0 in float32 would otherwise cut every token).
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    cut[:, 0] = False
    logits.scatter_(-1, order, sorted_logits.masked_fill(cut, -float("inf")))


def _draw(logits: torch.Tensor, batch: SamplingBatch, race: Race) -> torch.Tensor:
    """The random rows' tokens, from their `logits` (not changed)."""
    host, device = batch.host, batch.device
    scaled = logits / device["temperature"].float()[:, None]
    if host.min_p is not None:
        probs = scaled.softmax(dim=-1)
        floor = device["min_p"].float()[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled.masked_fill_(probs < floor, -float("inf"))
    if host.filters:
        _filter_top_k_top_p(scaled, device["top_k"], device["top_p"].float())
    return race(scaled.softmax(dim=-1), device["seeds"])


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: Callable[[torch.Tensor], torch.Tensor],
    race: Race,
) -> Sampled:
    """Tokens for each row of float32 `logits`, on their device."""
    host, device = batch.host, batch.device
    raw = None if host.logprob_rows is None else logits[device["logprob_rows"]]  # a copy
    if "grammar_rows" in device:  # structured output: what each row's grammar allows
        mask_by_grammar(logits, device["grammar_rows"], device["grammar_mask"])
    if host.adjustments.arrays:
        adjust(logits, device)
    if host.random_rows is None:
        tokens = argmax(logits)
    elif len(host.random_rows) == len(logits):  # no greedy row: no pass to find the largest
        tokens = _draw(logits, batch, race)
    else:
        tokens = argmax(logits)
        tokens[device["random_rows"]] = _draw(logits[device["random_rows"]], batch, race)
    if raw is None:
        return Sampled(tokens, None, [])
    rows = device["logprob_rows"]
    logprobs = raw.log_softmax(dim=-1)
    top_values, top_ids = logprobs.topk(max(host.top_logprobs), dim=-1)
    chosen = logprobs.gather(1, tokens[rows][:, None])
    table = torch.cat((chosen.double(), top_ids.double(), top_values.double()), dim=1)
    asking = list(zip(host.logprob_rows.tolist(), host.top_logprobs, strict=True))
    return Sampled(tokens, table, asking)
