"""vLLM's `prompt_logprobs`: for each prompt token after the first, its logprob given the tokens
before it, its rank, and the top N. A prompt position's logits come from the hidden state of
the position before, so each step computes them for the prompt tokens it runs (chunks
included); a request asking for them reads no prefix cache (the scheduler sees to that).

Rare, so priced apart: an extra lm_head over those positions and a second device-to-host copy,
only in steps that carry such a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from turnstile.executor_svc.plan_applier import StepInputs
from turnstile.shared.batch_table import BatchTable
from turnstile.shared.protocol import PromptLogprobs, SamplingParams


@dataclass(slots=True)
class PromptPositions:
    """The step's tokens whose next prompt token's logprob is asked for, on the host."""

    tokens: np.ndarray  # indices into the step's tokens (their hidden states)
    targets: np.ndarray  # the prompt token each predicts
    rows: list[tuple[int, int, int, int]]  # per request: req_id, first position, count, top N

    @classmethod
    def build(
        cls, inputs: StepInputs, batch: BatchTable, sampling: list[SamplingParams | None]
    ) -> PromptPositions | None:
        tokens, targets, rows = [], [], []
        starts = inputs.positions[inputs.query_start_loc[:-1]] if len(inputs.rows) else []
        for i, slot in enumerate(inputs.rows.tolist()):
            params = sampling[slot]
            if params is None or params.prompt_logprobs is None:
                continue
            start, end = int(starts[i]), int(starts[i]) + int(np.diff(inputs.query_start_loc)[i])
            end = min(end, int(batch.num_prompt[slot]) - 1)  # the last predicts no prompt token
            if end <= start:
                continue
            first = int(inputs.query_start_loc[i])
            tokens.append(np.arange(first, first + end - start))
            targets.append(batch.tokens[slot, start + 1 : end + 1])
            rows.append((int(batch.req_ids[slot]), start + 1, end - start, params.prompt_logprobs))
        if not rows:
            return None
        return cls(np.concatenate(tokens), np.concatenate(targets).astype(np.int64), rows)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"prompt_tokens": self.tokens, "prompt_targets": self.targets}


def prompt_table(logits: torch.Tensor, targets: torch.Tensor, width: int) -> torch.Tensor:
    """Per position, float64: the target's logprob, its rank (1: the likeliest), the top
    `width` ids, their logprobs."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(width, dim=-1) if width else (chosen[:, :0], rank[:, :0])
    return torch.cat((chosen.double(), rank.double(), top_ids.double(), top_values.double()), 1)


def fold(positions: PromptPositions, table: np.ndarray) -> list[PromptLogprobs]:
    """The host's copy of `prompt_table`, per request."""
    width = (table.shape[1] - 2) // 2
    out, at = [], 0
    for req_id, first, count, top in positions.rows:
        rows, targets = table[at : at + count], positions.targets[at : at + count].tolist()
        at += count
        ids = rows[:, 2 : 2 + top].astype(np.int64).tolist()
        values = rows[:, 2 + width : 2 + width + top].tolist()
        entries = [
            [(target, float(row[0])), *zip(row_ids, row_values, strict=True)]
            for target, row, row_ids, row_values in zip(targets, rows, ids, values, strict=True)
        ]
        out.append(PromptLogprobs(req_id, first, entries, rows[:, 1].astype(np.int64).tolist()))
    return out
