"""Iteration-level scheduling: one token budget a step, running requests first, then waiting ones.

`schedule()` builds the next `BatchPlan`; `update()` takes the executor's `StepResult` for the
oldest step in flight, fills in the sampled tokens, ends requests that hit a stop condition and
returns their `EngineOutputs`. The next step may be planned before the last one's result is
back (async scheduling): the stops it reveals then take effect one step later.
Steady decode is vector arithmetic over the running batch; Python loops only run over events
(a new block, an admission, an ending, a preemption). With speculative decoding a decoding row
also computes the tokens `ngram_drafter.py` drafts for it, and the result says which stood.
"""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.block_pool import BlockPool
from turnstile.scheduler_svc.in_flight import StepInFlight
from turnstile.scheduler_svc.lifecycle import RequestLifecycle, SchedulerStats
from turnstile.scheduler_svc.lora_limit import AdapterLimit
from turnstile.scheduler_svc.ngram_drafter import Drafts, NgramDrafter
from turnstile.scheduler_svc.priority_preemption import preempt_for_higher_priority
from turnstile.scheduler_svc.request import Request
from turnstile.scheduler_svc.running_batch import RunningBatch
from turnstile.scheduler_svc.step_result import take_result
from turnstile.scheduler_svc.token_budget import split_budget
from turnstile.scheduler_svc.waiting_queue import FcfsQueue, PriorityQueue
from turnstile.shared.batch_table import cdiv
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import (
    AddRequest,
    BatchPlan,
    EngineOutputs,
    Finished,
    NewRequest,
    StepResult,
    pack_ids,
)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, eos_token_ids: tuple[int, ...], vocab_size: int
    ) -> None:
        self.config = config
        self.lifecycle = RequestLifecycle(config, eos_token_ids, vocab_size)
        self.step = 0  # the latest planned
        self._steady = True  # as the last plan left the rows: each wants exactly one token
        speculation = config.scheduling.speculation
        self.drafter = None if speculation is None else NgramDrafter(speculation)

    # The requests' side, as the service, the offline engine and the tests use it.
    def add_request(self, msg: AddRequest, now: float = 0.0) -> None:
        self.lifecycle.add_request(msg, now)

    def abort(self, req_id: int) -> None:
        self.lifecycle.abort(req_id)

    def restart(self, num_blocks: int, failure: str = "") -> None:
        self.lifecycle.restart(num_blocks, failure)

    def fail_all(self, error: str) -> None:
        self.lifecycle.fail_all(error)

    def expire_waiting(self, now: float, max_wait: float) -> None:
        self.lifecycle.expire_waiting(now, max_wait)

    def take_finished(self) -> list[Finished]:
        return self.lifecycle.take_finished()

    @property
    def requests(self) -> dict[int, Request]:
        return self.lifecycle.requests

    @property
    def batch(self) -> RunningBatch:
        return self.lifecycle.batch

    @property
    def pool(self) -> BlockPool:
        return self.lifecycle.pool

    @property
    def waiting(self) -> FcfsQueue | PriorityQueue:
        return self.lifecycle.waiting

    @property
    def suspects(self) -> FcfsQueue:
        return self.lifecycle.suspects

    @property
    def stats(self) -> SchedulerStats:
        return self.lifecycle.stats

    @property
    def has_work(self) -> bool:
        return self.lifecycle.has_work

    @property
    def num_waiting(self) -> int:
        return self.lifecycle.num_waiting

    @property
    def rows_leaving_with_next_plan(self) -> list[int]:
        return self.lifecycle.rows_leaving_with_next_plan

    def wants_step(self, now: float) -> bool:
        """Whether to step now: there is work, and the admission policy does not wait."""
        if not self.has_work:
            return False
        first = self.waiting.peek()
        waited = None if first is None else now - first.arrived_at
        return self.lifecycle.admission.wants_step(len(self.batch), self.num_waiting, waited)

    def schedule(self) -> BatchPlan:
        self.step += 1
        budget = self.config.token_budget
        if self.config.sliding_window:
            for blocks in self.batch.release_behind(self.config.sliding_window):
                self.pool.release(blocks)
        if self.lifecycle.by_priority:
            preempt_for_higher_priority(self.lifecycle, self.config, budget)
        rows = self.batch.order
        steady = self._steady
        # Drafts are made from tokens known, so only with no step in flight (in lockstep).
        drafts = None
        if self.drafter is not None and not self.lifecycle.in_flight:
            drafts = self.drafter.propose(self.batch, rows)
        new_block_ids = self._schedule_decodes(rows) if steady and drafts is None else None
        if new_block_ids is not None:
            overridden = np.empty(0, dtype=np.int64)
            scheduled = overridden
            budget -= len(rows)
            preempted = False
        else:
            rows, scheduled, new_block_ids, preempted, drafts = self._schedule_running(
                rows, budget, drafts
            )
            overridden = np.flatnonzero(scheduled != 1)
            budget -= int(scheduled.sum())
        # After a preemption the freed room goes to the preempted, not to newcomers.
        closed = preempted or not self.lifecycle.admission.is_open(len(rows))
        prefilling = bool(len(overridden)) and bool((scheduled[overridden] > 0).any())
        new = [] if closed else self._admit(budget, prefilling)
        plan = BatchPlan(
            step=self.step,
            removed=pack_ids(self.lifecycle.take_removed()),
            new=new,
            override_ids=pack_ids(self.batch.req_ids[rows[overridden]]),
            override_counts=pack_ids(scheduled[overridden]),
            new_block_ids=pack_ids(new_block_ids),
            drafts=None if drafts is None else drafts.message(self.batch),
        )
        prefilled = rows[overridden]
        if new:
            admitted = np.array([self.batch.slot_of[n.req_id] for n in new], dtype=np.int64)
            prefilled = np.concatenate([prefilled, admitted])
        all_sample = steady and not new  # every row computed its one missing token
        record = StepInFlight.record(self.step, self.batch, prefilled, all_sample, drafts)
        self.lifecycle.in_flight.append(record)
        self._steady = record.steady_next
        return plan

    def _schedule_decodes(self, rows: np.ndarray) -> np.ndarray | None:
        """The steady-state step: every row decodes one token. Returns the new block ids, or
        None when blocks run short and the general path must choose victims."""
        at_boundary = self.batch.decode_block_rows(rows)
        if len(at_boundary) > self.pool.num_free:
            return None
        new_block_ids = self.pool.allocate(len(at_boundary))
        self.batch.append_blocks(at_boundary, new_block_ids)
        self.batch.num_computed[rows] += 1
        return new_block_ids

    def _schedule_running(
        self, rows: np.ndarray, budget: int, drafts: Drafts | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool, Drafts | None]:
        """Any step: split the budget, grant blocks, preempt when they run out."""
        batch = self.batch
        computed = batch.num_computed[rows]
        scheduled = split_budget(batch.wanted(rows), budget, self.config.whole_prompts)
        if drafts is not None:
            drafts = drafts.fit(rows, scheduled, budget - int(scheduled.sum()))
        need = batch.blocks_needed(rows, scheduled)
        total_need = int(need.sum())
        preempted = total_need > self.pool.num_free
        if preempted:
            rows, scheduled, need, new_block_ids = self._allocate_or_preempt(rows, scheduled, need)
            computed = batch.num_computed[rows]
            drafts = None if drafts is None else drafts.only(rows)
        else:
            new_block_ids = self.pool.allocate(total_need)
        batch.extend_blocks(rows, need, new_block_ids)
        batch.num_computed[rows] = computed + scheduled
        if drafts is not None:
            batch.append_drafts(drafts.slots, drafts.counts, drafts.tokens)
        return rows, scheduled, new_block_ids, preempted, drafts

    def update(self, result: StepResult) -> EngineOutputs:
        """Raises FrameError, changing nothing, for a result that does not fit the step."""
        return take_result(self.lifecycle, result, self.step)

    def _admit(self, budget: int, prefilling: bool) -> list[NewRequest]:
        new: list[NewRequest] = []
        block_size = self.config.block_size
        queue = self._admission_queue(prefilling)
        batch = self.batch
        adapters = AdapterLimit(
            self.config.max_loras, lambda: map(batch.requests.__getitem__, batch.order.tolist())
        )
        passed: list[Request] = []
        while budget > 0 and len(self.batch) < self.config.max_num_seqs:
            req = queue.peek()
            if req is None:
                break
            if not adapters.admits(req):
                passed.append(queue.pop())
                continue
            # A request asking for its prompt's logprobs computes every prompt token.
            wants_all = req.sampling.prompt_logprobs is not None
            cached = [] if wants_all else self.lifecycle.prefix_cache.lookup(req)
            num_cached = len(cached) * block_size
            count = min(len(req.token_ids) - num_cached, budget)
            if self.config.whole_prompts and count < len(req.token_ids) - num_cached:
                break  # an encoder's prompt: in the next step, whole
            need = cdiv(num_cached + count, block_size) - len(cached)
            idle_cached = sum(1 for block in cached if self.pool.ref_count[block] == 0)
            if need + idle_cached > self.pool.num_free:
                break
            queue.pop()
            self.pool.share(cached)
            blocks = cached + self.pool.allocate(need).tolist()
            slot = self.batch.admit(req, blocks, num_cached, self.lifecycle.by_priority)
            last = req.block_hashes[len(cached) - 1] if cached else req.cache_root
            self.batch.last_hash[slot] = last
            self.batch.num_computed[slot] += count
            self.stats.prefix_cache_queries += len(req.token_ids)
            self.stats.prefix_cache_hits += num_cached
            if req.cached_tokens is None:
                req.cached_tokens = num_cached
            new.append(
                NewRequest(
                    req_id=req.req_id,
                    token_ids=pack_ids(req.token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_computed=num_cached,
                    num_scheduled=count,
                    block_ids=pack_ids(blocks),
                    sampling=req.sampling,
                    lora=req.lora,
                )
            )
            budget -= count
            adapters.add(req)
            if queue is self.suspects:
                break  # its prompt computes alone: a failure of this step names it
        for req in reversed(passed):
            queue.push_front(req)
        return new

    def _admission_queue(self, prefilling: bool) -> FcfsQueue | PriorityQueue:
        """The suspects' queue while no suspect runs and no other prompt is computing, so each
        suspect's prompt computes alone; otherwise the waiting queue."""
        if not len(self.suspects) or prefilling:
            return self.waiting
        running = (self.batch.requests[slot] for slot in self.batch.order.tolist())
        alone = not any(req is not None and req.crashes for req in running)
        return self.suspects if alone else self.waiting

    def _allocate_or_preempt(
        self, rows: np.ndarray, scheduled: np.ndarray, need: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Grant blocks best-ranked row first; when they run out, preempt the worst-ranked row
        not yet served (possibly the one asking)."""
        pending = np.argsort(self.batch.rank[rows], kind="stable").tolist()
        granted: dict[int, np.ndarray] = {}
        dropped: list[int] = []
        served = 0
        while served < len(pending):
            position = pending[served]
            count = int(need[position])
            while count > self.pool.num_free and pending[-1] != position:
                dropped.append(pending.pop())
                self.lifecycle.preempt(int(rows[dropped[-1]]))
            if count > self.pool.num_free:
                dropped.append(pending.pop())
                self.lifecycle.preempt(int(rows[position]))
                break
            granted[position] = self.pool.allocate(count)
            served += 1
        keep = np.ones(len(rows), dtype=bool)
        keep[dropped] = False
        new_ids = [granted[p] for p in np.flatnonzero(keep).tolist()]
        new_ids = np.concatenate(new_ids) if new_ids else np.empty(0, dtype=np.int64)
        return rows[keep], scheduled[keep], need[keep], new_ids
