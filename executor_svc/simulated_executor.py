"""A stand-in executor with no model: applies plans exactly like a real one and answers with
scripted tokens, so the scheduler can be tested and benchmarked without torch.

Request r's i-th output token is a pure function of (seed, i), where the seed is the request's
sampling seed or else its id; its `output_len(seed)`-th token is EOS.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from turnstile.executor_svc.plan_applier import PlanApplier
from turnstile.shared.batch_table import spread
from turnstile.shared.protocol import BatchPlan, StepResult, pack_ids


def scripted_tokens(
    seeds: np.ndarray, index: np.ndarray, vocab_size: int, eos_token_id: int
) -> np.ndarray:
    """Token `index` of each seed's script, never EOS (EOS is placed by the output length)."""
    mixed = (seeds.astype(np.int64) * 1_000_003 + index.astype(np.int64) * 7_919) % (vocab_size - 1)
    return (mixed + (mixed >= eos_token_id)).astype(np.int32)


class SimulatedExecutor:
    def __init__(
        self,
        capacity: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        eos_token_id: int,
        output_len: Callable[[int], int],
    ) -> None:
        self.applier = PlanApplier(capacity, max_model_len, block_size)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.output_len = output_len
        self.seed = np.zeros(capacity, dtype=np.int64)
        self.script_len = np.zeros(capacity, dtype=np.int64)

    def execute(self, plan: BatchPlan) -> StepResult:
        inputs = self.applier.apply(plan)
        batch = self.applier.batch
        for new in plan.new:
            slot = batch.slot_of[new.req_id]
            seed = new.req_id if new.sampling.seed is None else new.sampling.seed
            self.seed[slot] = seed
            self.script_len[slot] = self.output_len(seed)
        rows = inputs.sample_rows
        index = batch.num_tokens[rows] - batch.num_prompt[rows]
        per = inputs.sample_counts
        if per is not None:  # drafts: each position samples, and the script judges them
            index, rows = spread(index, per), np.repeat(rows, per)
        tokens = scripted_tokens(self.seed[rows], index, self.vocab_size, self.eos_token_id)
        tokens[index == self.script_len[rows] - 1] = self.eos_token_id
        if self.applier.drafted is None:
            self.applier.commit(tokens)
            return StepResult(step=plan.step, sampled=pack_ids(tokens))
        verified = self.applier.verify(self.applier.reserve(), self.applier.drafted, tokens)
        return StepResult(
            step=plan.step,
            sampled=pack_ids(tokens[verified.kept]),
            num_sampled=pack_ids(verified.counts),
        )
