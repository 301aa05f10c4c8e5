"""Drives the real scheduler against the simulated executor over encoded plans, and checks the
invariants of DESIGN.md §3 after any step."""

from __future__ import annotations

from collections import defaultdict, deque

import msgspec
import numpy as np

from turnstile.executor_svc.plan_applier import PlanApplier
from turnstile.executor_svc.simulated_executor import SimulatedExecutor, scripted_tokens
from turnstile.scheduler_svc.request import Status
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.batch_table import cdiv
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import (
    AddRequest,
    BatchPlan,
    EngineOutputs,
    LoraRef,
    SamplingParams,
    StepResult,
    pack_ids,
    unpack_ids,
)

VOCAB = 1000
EOS = 2

_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(BatchPlan)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def expected_output(seed: int, script_len: int, limit: int) -> tuple[list[int], str]:
    """Tokens and finish reason of a request whose script ends with EOS at `script_len`,
    cut at `limit` tokens (max_tokens or the context)."""
    count = min(script_len, limit)
    tokens = scripted_tokens(np.full(count, seed), np.arange(count), VOCAB, EOS).tolist()
    if script_len <= limit:
        tokens[script_len - 1] = EOS
        return tokens, "stop"
    return tokens, "length"


class Harness:
    """`ahead`: how many plans the scheduler sends before the oldest one's result is back
    (0: lockstep; 1: async scheduling, as the service runs it)."""

    def __init__(
        self,
        config: SchedulerConfig,
        script_len: dict[int, int],
        ahead: int = 0,
        eos_token_ids: tuple[int, ...] = (EOS,),
    ) -> None:
        self.config = config
        self.ahead = ahead
        self.sent: deque[BatchPlan] = deque()
        self.scheduler = Scheduler(config, eos_token_ids=eos_token_ids, vocab_size=VOCAB)
        self.executor = SimulatedExecutor(
            config.max_num_seqs,
            config.max_model_len,
            config.block_size,
            VOCAB,
            EOS,
            script_len.__getitem__,
        )
        # The executor's batch as the plans alone build it (its tokens lag: nothing samples).
        self.planned = PlanApplier(config.max_num_seqs, config.max_model_len, config.block_size)
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.endings: dict[int, list[str]] = defaultdict(list)
        self.plans: list[BatchPlan] = []

    def add(
        self,
        req_id: int,
        prompt: list[int],
        max_tokens: int,
        priority: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: tuple[int, ...] = (),
        lora: LoraRef | None = None,
        embed: bool = False,
    ) -> None:
        self.scheduler.add_request(
            AddRequest(
                req_id=req_id,
                prompt_ids=pack_ids(prompt),
                max_tokens=max_tokens,
                sampling=SamplingParams(seed=req_id, embed=embed),
                priority=priority,
                ignore_eos=ignore_eos,
                stop_token_ids=list(stop_token_ids),
                lora=lora,
            )
        )

    def step(self) -> BatchPlan:
        """Send plans until `ahead` wait behind the oldest, then run that one and take its
        result back."""
        while len(self.sent) <= self.ahead and (self.scheduler.has_work or not self.sent):
            self.sent.append(self.send())
        return self.step_sent(self.sent.popleft())

    def step_sent(self, plan: BatchPlan) -> BatchPlan:
        """Run a plan already sent, and take its result back."""
        result = _result_decoder.decode(_encoder.encode(self.executor.execute(plan)))
        if plan.drafts is not None:
            self._follow_drafts(plan)
        self._record(self.scheduler.update(result))
        return plan

    def _follow_drafts(self, plan: BatchPlan) -> None:
        """A drafted row's computed tokens and blocks depend on its result (the drafts that
        stood): the plans' mirror takes them from the executor."""
        assert plan.drafts is not None
        executed, planned = self.executor.applier.batch, self.planned.batch
        for req_id in unpack_ids(plan.drafts.req_ids).tolist():
            if req_id in executed.slot_of and req_id in planned.slot_of:
                ours, theirs = planned.slot_of[req_id], executed.slot_of[req_id]
                planned.num_computed[ours] = executed.num_computed[theirs]
                planned.num_blocks[ours] = executed.num_blocks[theirs]

    def send(self) -> BatchPlan:
        """A plan, as the executor decodes it; the plans' own mirror applies it."""
        plan = _plan_decoder.decode(_encoder.encode(self.scheduler.schedule()))
        self.plans.append(plan)
        self.planned.apply(plan)
        return plan

    def replace_executor(self) -> None:
        """A replacement executor registers: an empty batch, at the scheduler's next step."""
        cfg = self.config
        self.executor.applier = PlanApplier(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
        self.planned = PlanApplier(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
        self.executor.applier.step = self.planned.step = self.scheduler.step
        self.sent.clear()

    def abort(self, req_id: int) -> None:
        self.scheduler.abort(req_id)
        for ended in self.scheduler.take_finished():
            self.endings[ended.req_id].append(ended.reason)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work and not self.sent:
                return
            self.step()
            self.check_invariants()
        raise AssertionError(f"still busy after {max_steps} steps")

    def _record(self, outputs: EngineOutputs) -> None:
        for req_id, token in zip(
            unpack_ids(outputs.req_ids).tolist(),
            unpack_ids(outputs.token_ids).tolist(),
            strict=True,
        ):
            assert req_id not in self.endings, f"a token for request {req_id} after its end"
            self.tokens[req_id].append(token)
        for ended in outputs.finished:
            self.endings[ended.req_id].append(ended.reason)

    def check_invariants(self) -> None:
        scheduler, pool, batch = self.scheduler, self.scheduler.pool, self.scheduler.batch
        owners = np.zeros(pool.num_blocks, dtype=np.int64)
        window = scheduler.config.sliding_window
        for slot in batch.order.tolist():
            blocks = batch.blocks_of(slot)
            # Blocks released behind a sliding window stay in the table but are not held, and
            # none of them is still visible from the row's next token.
            released = int(batch.num_released[slot])
            np.add.at(owners, blocks[released:], 1)
            assert released == 0 or window
            assert released * batch.block_size <= max(0, int(batch.num_computed[slot]) - window + 1)
            # Block tables cover exactly the computed tokens.
            assert len(blocks) == cdiv(int(batch.num_computed[slot]), batch.block_size)
            # A held block a prefix lookup would return holds the tokens it is published with.
            size = batch.block_size
            for i in range(released, int(batch.num_computed[slot]) // size):
                published = pool.cached_tokens(int(blocks[i]))
                if published is not None:
                    assert (published == batch.tokens[slot, i * size : (i + 1) * size]).all()
        # Every block is free xor owned, with the right reference count.
        assert (pool.ref_count == owners).all()
        for block in range(pool.num_blocks):
            assert pool.is_free(block) == (owners[block] == 0)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert pool.num_free == int((owners == 0).sum())
        # The executor's view, rebuilt from plans alone, equals the scheduler's: rows, computed
        # tokens and blocks as planned; the tokens the scheduler knows are the executor's, or
        # the first of them while results are still on their way.
        # Rows that ended since the last plan leave the executor with the next plan.
        planned, executed = self.planned.batch, self.executor.applier.batch
        leaving = set(scheduler.rows_leaving_with_next_plan)
        mirrored = [s for s in planned.order.tolist() if int(planned.req_ids[s]) not in leaving]
        assert batch.req_ids[batch.order].tolist() == planned.req_ids[mirrored].tolist()
        for slot, other in zip(batch.order.tolist(), mirrored, strict=True):
            assert batch.num_computed[slot] == planned.num_computed[other]
            assert batch.blocks_of(slot).tolist() == planned.blocks_of(other).tolist()
            executed_slot = executed.slot_of.get(int(batch.req_ids[slot]))
            if executed_slot is not None:
                ours = batch.real_tokens(slot).tolist()
                theirs = executed.known_tokens(executed_slot).tolist()
                shorter = min(len(ours), len(theirs))
                assert ours[:shorter] == theirs[:shorter]
                assert self.sent or ours == theirs
        # Rows run live requests, or (static padded batching) ended ones computing as padding.
        rows = [batch.requests[slot] for slot in batch.order.tolist()]
        live = {req.req_id for req in rows if req is not None and req.status is Status.RUNNING}
        padding = {req.req_id for req in rows if req is not None and req.status is Status.FINISHED}
        assert len(live) + len(padding) == len(rows)
        assert live <= set(scheduler.requests) and not padding & set(scheduler.requests)
        if padding:
            assert scheduler.config.scheduling.static_batching == "padded" and live
