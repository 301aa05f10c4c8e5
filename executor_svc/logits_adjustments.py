"""What a request asks to change in its logits before a token is picked, as vLLM defines it:
allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition, frequency and
presence penalties (in that order, as vLLM's sampler; greedy rows obey them too).

The host gathers the rows that want any of it into flat (row, token) arrays once a step; they
travel with the step's one upload, and `adjust` applies each kind to the whole batch in one
scatter on the device, with no host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from turnstile.shared.protocol import SamplingParams

# A row's tokens so far: (prompt ids, generated ids).
History = Callable[[int], tuple[np.ndarray, np.ndarray]]
_NO_PENALTY = (1.0, 0.0, 0.0)
_NONE = np.empty(0, dtype=np.int64)


def _pairs(rows: list[int], ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Flat (row, token) arrays: row `rows[i]` once for each id of `ids[i]`."""
    if not rows:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    counts = [len(group) for group in ids]
    flat = np.concatenate(ids).astype(np.int64) if sum(counts) else np.empty(0, dtype=np.int64)
    return np.repeat(np.array(rows, dtype=np.int64), counts), flat


def _banned(params: SamplingParams, generated: np.ndarray, output_index: int) -> list[int]:
    """Tokens this row may not pick now: the last token of each bad word whose other tokens
    end its output, and its stop tokens while it has fewer than min_tokens."""
    banned = list(params.min_tokens_stop_ids) if output_index < params.min_tokens else []
    for word in params.bad_words:
        head = len(word) - 1
        if head == 0 or (len(generated) >= head and generated[-head:].tolist() == word[:-1]):
            banned.append(word[-1])
    return banned


@dataclass(slots=True)
class LogitsAdjustments:
    """One step's adjustments on the host: `arrays` to upload, and which kinds are present."""

    arrays: dict[str, np.ndarray]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_index: np.ndarray,
        history: History,
        adjusting: np.ndarray | None = None,
    ) -> LogitsAdjustments:
        """`params[i]`, `output_index[i]` and `history(i)`: sampling row i's; `adjusting`: the
        rows that have adjustments (None: any may)."""
        allowed_rows, allowed, banned_rows, banned = [], [], [], []
        bias_rows, bias_ids, bias_values = [], [], []
        penalty_rows, penalties, prompts, outputs = [], [], [], []
        for row in range(len(params)) if adjusting is None else adjusting.tolist():
            p = params[row]
            if p.allowed_token_ids:
                allowed_rows.append(row)
                allowed.append(np.asarray(p.allowed_token_ids))
            penalty = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
            wants_history = bool(p.bad_words) or penalty != _NO_PENALTY
            prompt, generated = history(row) if wants_history else (_NONE, _NONE)
            if p.bad_words or int(output_index[row]) < p.min_tokens:
                ban = _banned(p, generated, int(output_index[row]))
                if ban:
                    banned_rows.append(row)
                    banned.append(np.asarray(ban))
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_ids += [token for token, _ in p.logit_bias]
                bias_values += [value for _, value in p.logit_bias]
            if penalty != _NO_PENALTY:
                penalty_rows.append(row)
                penalties.append(penalty)
                prompts.append(prompt)
                outputs.append(generated)
        arrays: dict[str, np.ndarray] = {}
        if allowed_rows:
            local, ids = _pairs(list(range(len(allowed_rows))), allowed)
            arrays |= {"allowed_rows": np.array(allowed_rows), "allowed_local": local,
                       "allowed_ids": ids}  # fmt: skip
        if banned_rows:
            arrays["banned_rows"], arrays["banned_ids"] = _pairs(banned_rows, banned)
        if bias_rows:
            arrays |= {"bias_rows": np.array(bias_rows), "bias_ids": np.array(bias_ids),
                       "bias_values": np.array(bias_values, dtype=np.float64)}  # fmt: skip
        if penalty_rows:
            local = list(range(len(penalty_rows)))
            arrays["penalty_rows"] = np.array(penalty_rows)
            arrays["penalties"] = np.array(penalties, dtype=np.float64)
            arrays["prompt_local"], arrays["prompt_ids"] = _pairs(local, prompts)
            arrays["output_local"], arrays["output_ids"] = _pairs(local, outputs)
        return cls(arrays)


def adjust(logits: torch.Tensor, device: dict[str, torch.Tensor]) -> None:
    """Apply (in place, on float32 `logits`) what `LogitsAdjustments.arrays` uploaded."""
    if "allowed_rows" in device:
        rows = device["allowed_rows"]
        keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[device["allowed_local"], device["allowed_ids"]] = True
        logits[rows] = logits[rows].masked_fill(~keep, -float("inf"))
    if "banned_rows" in device:
        logits[device["banned_rows"], device["banned_ids"]] = -float("inf")
    if "bias_rows" in device:
        bias = device["bias_values"].float()
        logits.index_put_((device["bias_rows"], device["bias_ids"]), bias, accumulate=True)
    if "penalty_rows" in device:
        rows = device["penalty_rows"]
        chosen = logits[rows]
        counts = torch.zeros_like(chosen)
        ones = torch.ones_like(device["output_ids"], dtype=chosen.dtype)
        counts.index_put_((device["output_local"], device["output_ids"]), ones, accumulate=True)
        seen = counts > 0
        seen[device["prompt_local"], device["prompt_ids"]] = True
        repetition, frequency, presence = device["penalties"].float().unbind(dim=1)
        # Repetition (prompt and output tokens): a positive logit shrinks, a negative grows.
        factor = torch.where(chosen > 0, 1 / repetition[:, None], repetition[:, None])
        chosen = torch.where(seen, chosen * factor, chosen)
        # Frequency and presence (output tokens only), OpenAI's definition.
        chosen -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
        logits[rows] = chosen


def mask_by_grammar(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """Mask (in place) what each grammar row's bitmask forbids: bit j of its word w is token
    32w + j (xgrammar's layout). Each byte of the words picks its 8 additive entries (0 or
    -inf) from a table: a gather and an add, 3x faster on the CPU than unpacking bits into a
    boolean mask for `masked_fill`."""
    table = _byte_table(logits.device)
    byte_values = (words[:, :, None] >> torch.arange(0, 32, 8, device=logits.device)) & 255
    additive = table.index_select(0, byte_values.reshape(-1)).reshape(len(rows), -1)
    logits.index_add_(0, rows, additive[:, : logits.shape[1]])


@functools.cache
def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit j is set, else -inf."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return torch.zeros(256, 8, device=device).masked_fill_(bits == 0, -float("inf"))
