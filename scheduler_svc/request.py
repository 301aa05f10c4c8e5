"""A request as the scheduler sees it, from arrival to its one and only end."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from turnstile.scheduler_svc.block_pool import salt_root
from turnstile.shared.protocol import AddRequest, LoraRef, SamplingParams, constrains, unpack_ids

# Preemption and queue order key: (priority, arrival) packed in one int64, lower runs first.
_ARRIVAL_BITS = 40
_PRIORITY_LIMIT = 1 << 20
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    req_id: int
    token_ids: np.ndarray
    num_prompt_tokens: int
    stop_len: int
    stops_at_eos: bool
    stop_token_ids: frozenset[int]
    priority: int
    arrival: int
    sampling: SamplingParams
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    arrived_at: float = 0.0  # the caller's clock; only queue deadlines read it
    crashes: int = 0  # failed steps it ran in (a suspect if > 0; ended at 2)
    cached_tokens: int | None = None  # prefix-cache hits at its first admission
    # Its cache salt's and adapter's chain seed (`block_pool.salt_root`): KV blocks are shared
    # only within one salt and one adapter, whose KV differs. 0: neither.
    cache_root: int = 0
    lora: LoraRef | None = None  # its LoRA adapter
    # Whether it may verify drafted tokens (speculative decoding): a grammar's matcher takes
    # the drafts in turn (`may_speculate`).
    speculates: bool = False

    @classmethod
    def from_message(
        cls, msg: AddRequest, arrival: int, max_model_len: int, vocab_size: int,
        enable_lora: bool = False, max_logprobs: int = MAX_LOGPROBS,
    ) -> Request:  # fmt: skip
        """Raises ValueError, naming the field, for anything the executor could not run."""
        prompt = unpack_ids(msg.prompt_ids).copy()
        _check(msg, prompt, vocab_size)
        _check_logprobs(msg.sampling, vocab_size if max_logprobs < 0 else max_logprobs)
        if msg.lora is not None and not enable_lora:
            raise ValueError(f"lora {msg.lora.name}: the executors run no LoRA adapters")
        return cls(
            req_id=msg.req_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            stop_len=min(len(prompt) + msg.max_tokens, context_limit(msg.sampling, max_model_len)),
            stops_at_eos=not msg.ignore_eos,
            stop_token_ids=frozenset(msg.stop_token_ids),
            priority=msg.priority,
            arrival=arrival,
            sampling=msg.sampling,
            cache_root=salt_root(msg.cache_salt, msg.lora.digest if msg.lora else ""),
            lora=msg.lora,
            speculates=may_speculate(msg.sampling),
        )

    def rank(self, by_priority: bool) -> int:
        priority = self.priority + _PRIORITY_LIMIT if by_priority else 0
        return (priority << _ARRIVAL_BITS) | self.arrival


def context_limit(sampling: SamplingParams, max_model_len: int) -> int:
    """How long a request's row may grow: a pooled prompt may fill the whole context (as vLLM
    allows), its one sampled and dropped token past it."""
    return max_model_len + 1 if sampling.embed else max_model_len


def may_speculate(sampling: SamplingParams) -> bool:
    """Not where the executor follows a reasoning model's thinking on the host, token by token:
    a thinking budget, or a grammar waiting for the thinking's end."""
    thinking = sampling.thinking_budget >= 0 or (constrains(sampling) and sampling.think_end >= 0)
    return not (thinking or sampling.embed or sampling.prompt_logprobs is not None)


def _check(msg: AddRequest, prompt: np.ndarray, vocab_size: int) -> None:
    if len(prompt) and not (prompt.min() >= 0 and prompt.max() < vocab_size):
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in msg.stop_token_ids):
        raise ValueError(f"stop_token_ids must lie in [0, {vocab_size})")
    if msg.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if not -_PRIORITY_LIMIT <= msg.priority < _PRIORITY_LIMIT:
        raise ValueError(f"priority must lie in [{-_PRIORITY_LIMIT}, {_PRIORITY_LIMIT})")
    sampling = msg.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise ValueError("temperature must be a finite number >= 0")
    if not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        raise ValueError("top_p must lie in (0, 1]")
    if sampling.top_k < 0:
        raise ValueError("top_k must be >= 0 (0: no limit)")
    if sampling.seed is not None and not -(2**63) <= sampling.seed < 2**64:
        raise ValueError("seed must fit in 64 bits")
    if sampling.second_text != -1 and not (sampling.embed and sampling.second_text >= 0):
        raise ValueError("second_text must be -1, or a pooled pair's position >= 0")
    _check_adjustments(sampling, vocab_size)


def _check_logprobs(sampling: SamplingParams, limit: int) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sampling, name)
        if value is not None and not 0 <= value <= limit:
            raise ValueError(f"{name} must lie in [0, {limit}] (--max-logprobs)")


def _check_adjustments(sampling: SamplingParams, vocab_size: int) -> None:
    """The logits adjustments' bounds, as the gateway's types state them."""
    ranges = {
        "min_p": (sampling.min_p, 0.0, 1.0),
        "repetition_penalty": (sampling.repetition_penalty, 1e-9, 2.0),
        "frequency_penalty": (sampling.frequency_penalty, -2.0, 2.0),
        "presence_penalty": (sampling.presence_penalty, -2.0, 2.0),
    }
    for name, (value, low, high) in ranges.items():
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"{name} must lie in [{low:g}, {high:g}]")
    if not all(math.isfinite(v) and abs(v) <= 100 for _, v in sampling.logit_bias):
        raise ValueError("logit_bias values must lie in [-100, 100]")
    if len(sampling.allowed_token_ids) > vocab_size or sampling.min_tokens < 0:
        raise ValueError("allowed_token_ids is longer than the vocabulary, or min_tokens < 0")
    ids = [t for t, _ in sampling.logit_bias] + sampling.allowed_token_ids
    ids += sampling.min_tokens_stop_ids + [t for word in sampling.bad_words for t in word]
    ids += [sampling.think_end] if sampling.think_end != -1 else []
    if any(not 0 <= t < vocab_size for t in ids) or not all(sampling.bad_words):
        raise ValueError(
            f"logit_bias, allowed_token_ids, bad_words, think_end: ids in [0, {vocab_size})"
        )
    if sampling.thinking_budget < -1 or (sampling.thinking_budget >= 0 > sampling.think_end):
        raise ValueError("thinking_budget must be -1 (none), or >= 0 with a think_end")
