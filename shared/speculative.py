"""Speculative decoding's settings, vLLM's `--speculative-config` JSON. Only the n-gram method
(prompt lookup) is served: it needs no draft model, and its drafts are made by the scheduler
from each request's own tokens (`scheduler_svc/ngram_drafter.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True, frozen=True)
class Speculation:
    num_speculative_tokens: int  # drafted tokens a row verifies per step, at most
    prompt_lookup_min: int  # the shortest suffix looked up in the request's tokens
    prompt_lookup_max: int  # the longest


def parse_speculation(text: str | None) -> Speculation | None:
    """`--speculative-config`'s JSON; raises ValueError naming what it does not serve."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not served (only ngram's)")
    method = config.get("method")
    if method not in ("ngram", "[ngram]"):
        raise ValueError(f"--speculative-config: method {method!r} not served; only 'ngram'")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"--speculative-config: num_speculative_tokens must be an integer in "
            f"[1, {MAX_SPECULATIVE_TOKENS}]"
        )
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    # vLLM's defaults: both 5 when neither is given, else the one given for both.
    low, high = (5, 5) if low is None and high is None else (low or high, high or low)
    if not all(isinstance(n, int) and n >= 1 for n in (low, high)) or low > high:
        raise ValueError(
            "--speculative-config: prompt_lookup_min and prompt_lookup_max must be integers "
            ">= 1, min <= max"
        )
    return Speculation(k, low, high)
