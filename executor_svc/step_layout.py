"""Which of a step's rows decode and which prefill, and the arrays each route needs, worked
out on the host from the plan's arrays: the device then indexes with them and never has to
ask for a count (no host sync inside the forward pass)."""

from __future__ import annotations

import numpy as np

from turnstile.executor_svc.plan_applier import StepInputs

# A step whose prefill chunks are short may run every token as a row of its own through a
# backend's fused decode layers, each attending its sequence up to itself; a token then reads
# its whole context, where a batched prefill reads it once per chunk. Hence two limits (the
# figures: docs/benchmarks.md, "Where a decode step goes").
SHORT_PREFILL_TOKENS = 512
SHORT_PREFILL_CONTEXT = 32768  # summed over the prefill tokens: the positions they attend


class StepLayout:
    def __init__(self, inputs: StepInputs) -> None:
        self.inputs = inputs
        start = inputs.query_start_loc
        self.query_lens = np.diff(start)
        self.decode_rows = np.flatnonzero(self.query_lens == 1)
        self.prefill_rows = np.flatnonzero(self.query_lens != 1)
        self.decode_tokens = start[self.decode_rows]
        lens = self.query_lens[self.prefill_rows]
        self.prefill_start = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=self.prefill_start[1:])
        first = np.repeat(start[self.prefill_rows] - self.prefill_start[:-1], lens)
        self.prefill_tokens = first + np.arange(self.prefill_start[-1], dtype=np.int64)
        self.longest = int(lens.max()) if len(lens) else 0
        self.from_start = bool(len(lens)) and not inputs.positions[start[self.prefill_rows]].any()

    def short_prefill(self) -> bool:
        """Whether the prefill tokens are few enough to run as rows of their own."""
        tokens = self.prefill_tokens
        if not 0 < len(tokens) <= SHORT_PREFILL_TOKENS:
            return False
        context = int(self.inputs.positions[tokens].sum()) + len(tokens)
        return context <= SHORT_PREFILL_CONTEXT

    def token_rows(self) -> np.ndarray:
        """The row of each of the step's tokens."""
        return np.repeat(np.arange(len(self.query_lens)), self.query_lens)

    def arrays(self, route: str) -> dict[str, np.ndarray]:
        """What `Backend.upload` sends for `route` (a `Route` value)."""
        inputs = self.inputs
        out = {
            "input_ids": inputs.input_ids,
            "positions": inputs.positions,
            "logits_indices": inputs.logits_indices,
        }
        if inputs.lora_tokens is not None:
            out["lora_tokens"] = inputs.lora_tokens
        if route == "encoder":  # every row a whole prompt (`SchedulerConfig.whole_prompts`)
            # Whole: from its first token to its last, which samples.
            if inputs.positions[inputs.query_start_loc[:-1]].any() or len(
                inputs.sample_rows
            ) != len(inputs.rows):
                raise RuntimeError("an encoder's step holds a row that is not a whole prompt")
            out |= {"encoder_rows": self.token_rows(), "encoder_starts": inputs.query_start_loc}
            return out if inputs.token_types is None else out | {"token_types": inputs.token_types}
        if route == "fused":
            if len(self.prefill_rows):  # each token a row, attending up to itself
                tables, lens = inputs.block_tables[self.token_rows()], inputs.positions + 1
            else:
                tables, lens = inputs.block_tables, inputs.seq_lens
            return out | {"slot_mapping": inputs.slot_mapping, "fused_tables": tables,
                          "fused_lens": lens}  # fmt: skip
        decode, prefill = self.decode_rows, self.prefill_rows
        if len(decode):
            out["decode_tables"] = inputs.block_tables[decode]
            out["decode_lens"] = inputs.seq_lens[decode]
        if len(prefill):
            out["prefill_tables"] = inputs.block_tables[prefill]
            out["prefill_lens"] = inputs.seq_lens[prefill]
            out["prefill_start"] = self.prefill_start
        if route == "split":
            slots = inputs.slot_mapping
            out["decode_slots"] = slots[self.decode_tokens]
            out["prefill_slots"] = slots[self.prefill_tokens]
        else:
            out["slot_mapping"] = inputs.slot_mapping
        if len(decode) and len(prefill):  # each kind alone needs no index
            out["decode_tokens"] = self.decode_tokens
            out["prefill_tokens"] = self.prefill_tokens
        return out
