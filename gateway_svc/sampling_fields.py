"""A request's sampling fields as the executor's `SamplingParams`: the model's defaults where
the request leaves a field out, token ids checked against the vocabulary, bad words tokenized."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.shared.protocol import SamplingParams
from turnstile.shared.tokenizer import Tokenizer

Request = CompletionRequest | ChatCompletionRequest
# What a field left out means when the model sets no default (--generation-config none).
NEUTRAL_SAMPLING = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}  # fmt: skip
OUTPUT_LIMIT = "max_new_tokens"  # generation_config.json's name for max_tokens


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for the fields it leaves out, and the most output any may ask for."""

    sampling: dict[str, float] = dataclasses.field(default_factory=dict)  # temperature, top_p...
    max_tokens: int | None = None  # max_new_tokens: a chat's output where it sets no max_tokens
    max_tokens_limit: int | None = None  # the override's max_new_tokens: every request's, as vLLM


def model_sampling_defaults(
    found: dict[str, float] | None, override: dict[str, float] | None = None
) -> RequestDefaults:
    """The defaults for requests that leave fields out: the model's (generation_config.json's)
    under `override` (--override-generation-config); one outside the range a request may ask
    for, or that is no sampling setting, is refused at start, by name. `max_new_tokens` is a
    chat's default output; from the override it also limits every request (vLLM's meaning)."""
    unknown = sorted(set(override or {}) - {*NEUTRAL_SAMPLING, OUTPUT_LIMIT})
    if unknown:
        raise ValueError(f"--override-generation-config: {unknown[0]!r} is not supported (only "
                         f"{', '.join(NEUTRAL_SAMPLING)}, {OUTPUT_LIMIT})")  # fmt: skip
    defaults = {**(found or {}), **(override or {})}
    most = defaults.pop(OUTPUT_LIMIT, None)
    if most is not None and (most < 1 or most != int(most)):
        raise ValueError(f"generation_config.json or --override-generation-config: "
                         f"{OUTPUT_LIMIT} must be a whole number >= 1, not {most}")  # fmt: skip
    try:
        msgspec.convert({**defaults, "prompt": ""}, CompletionRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"generation_config.json or --override-generation-config: {exc}") from None
    limit = (override or {}).get(OUTPUT_LIMIT)
    return RequestDefaults(
        defaults, None if most is None else int(most), None if limit is None else int(limit)
    )


def sampling_params(
    request: Request, tokenizer: Tokenizer, model_defaults: dict[str, float], max_tokens: int
) -> SamplingParams:
    defaults = NEUTRAL_SAMPLING | model_defaults

    def field(name: str) -> Any:
        value = getattr(request, name)
        return defaults[name] if value is None else value

    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be at most max_tokens ({max_tokens})",
                       param="min_tokens")  # fmt: skip
    stop_ids = list(request.stop_token_ids or ())
    if not request.ignore_eos:
        stop_ids += tokenizer.info.all_eos_token_ids
    return SamplingParams(
        temperature=field("temperature"),
        top_p=field("top_p"),
        top_k=max(int(field("top_k")), 0),
        seed=request.seed,
        logprobs=_logprobs(request),
        min_p=field("min_p"),
        repetition_penalty=field("repetition_penalty"),
        frequency_penalty=field("frequency_penalty"),
        presence_penalty=field("presence_penalty"),
        logit_bias=_logit_bias(request.logit_bias or {}, tokenizer.vocab_size),
        allowed_token_ids=_in_vocabulary(
            request.allowed_token_ids or [], tokenizer.vocab_size, "allowed_token_ids"
        ),
        bad_words=_bad_words(request.bad_words or [], tokenizer),
        min_tokens=min_tokens,
        min_tokens_stop_ids=sorted(set(stop_ids)) if min_tokens else [],
        prompt_logprobs=request.prompt_top,
    )


def _logprobs(request: Request) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _in_vocabulary(ids: list[int], vocab_size: int, name: str) -> list[int]:
    if any(not 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"{name}: token ids must lie in [0, {vocab_size})", param=name)
    return ids


def _logit_bias(bias: dict[str, float], vocab_size: int) -> list[tuple[int, float]]:
    try:
        ids = [int(key) for key in bias]
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    return list(zip(_in_vocabulary(ids, vocab_size, "logit_bias"), bias.values(), strict=True))


def _bad_words(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each word's tokens as it starts a text and after a space, as vLLM bans both."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
