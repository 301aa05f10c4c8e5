"""Iteration-level scheduling: one token budget a step, running requests first, then waiting ones.

`schedule()` builds the next `BatchPlan`; `update()` takes the executor's `StepResult`, appends
the sampled tokens, ends requests that hit a stop condition and returns their `EngineOutputs`.
Steady decode is vector arithmetic over the running batch; Python loops only run over events
(a new block, an admission, an ending, a preemption).
"""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.lifecycle import RequestLifecycle
from turnstile.scheduler_svc.waiting_queue import FcfsQueue, PriorityQueue
from turnstile.shared.batch_table import cdiv
from turnstile.shared.protocol import (
    BatchPlan,
    EngineOutputs,
    FrameError,
    NewRequest,
    StepResult,
    pack_ids,
    unpack_ids,
)


def split_budget(want: np.ndarray, budget: int) -> np.ndarray:
    """Tokens each running row computes: every decode first, then prefill chunks in row order,
    so a long prompt can never starve the decodes."""
    scheduled = np.zeros_like(want)
    decodes = np.flatnonzero(want == 1)[:budget]
    scheduled[decodes] = 1
    room = budget - len(decodes)
    prefills = np.flatnonzero(want > 1)
    if room > 0 and len(prefills):
        wanted = want[prefills]
        scheduled[prefills] = np.clip(room - (np.cumsum(wanted) - wanted), 0, wanted)
    return scheduled


class Scheduler(RequestLifecycle):
    def wants_step(self, now: float) -> bool:
        """Whether to step now: there is work, and no static batch is still filling. A static
        server opens its next batch once it is full or its first request has waited the fill
        timeout, so requests sent together share a batch, as at a static server with a
        batching window (and as `bench compare`'s ideal ratio assumes), even though they reach
        the scheduler one by one."""
        config = self.config
        if not self.has_work:
            return False
        if (
            config.scheduling.static_batching is None
            or len(self.batch)
            or self.num_waiting >= config.max_num_seqs
        ):
            return True
        first = self.waiting.peek()
        return first is None or now - first.arrived_at >= config.scheduling.static_fill_timeout

    def schedule(self) -> BatchPlan:
        if self._in_flight:
            raise RuntimeError("schedule() called again before update()")
        self.step += 1
        budget = self.config.scheduling.max_num_batched_tokens
        if self.by_priority:
            self._preempt_for_higher_priority(budget)
        rows = self.batch.order
        new_block_ids = None if self._prefilling else self._schedule_decodes(rows)
        if new_block_ids is not None:
            overridden = np.empty(0, dtype=np.int64)
            scheduled = overridden
            budget -= len(rows)
            preempted = False
        else:
            rows, scheduled, new_block_ids, preempted = self._schedule_running(rows, budget)
            overridden = np.flatnonzero(scheduled != 1)
            budget -= int(scheduled.sum())
        # After a preemption the freed room goes to the preempted, not to newcomers.
        closed = preempted or (self.config.scheduling.static_batching is not None and len(rows) > 0)
        prefilling = bool(len(overridden)) and bool((scheduled[overridden] > 0).any())
        new = [] if closed else self._admit(budget, prefilling)
        plan = BatchPlan(
            step=self.step,
            removed=pack_ids(self._removed),
            new=new,
            override_ids=pack_ids(self.batch.req_ids[rows[overridden]]),
            override_counts=pack_ids(scheduled[overridden]),
            new_block_ids=pack_ids(new_block_ids),
        )
        self._removed = []
        self._prefilling = rows[overridden].tolist() + [self.batch.slot_of[n.req_id] for n in new]
        self._in_flight = True
        return plan

    def _schedule_decodes(self, rows: np.ndarray) -> np.ndarray | None:
        """The steady-state step: every row decodes one token. Returns the new block ids, or
        None when blocks run short and the general path must choose victims."""
        computed = self.batch.num_computed[rows]
        at_boundary = rows[computed % self.config.block_size == 0]
        if len(at_boundary) > self.pool.num_free:
            return None
        new_block_ids = self.pool.allocate(len(at_boundary))
        self.batch.append_blocks(at_boundary, new_block_ids)
        self.batch.num_computed[rows] = computed + 1
        return new_block_ids

    def _schedule_running(
        self, rows: np.ndarray, budget: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Any step: split the budget, grant blocks, preempt when they run out."""
        computed = self.batch.num_computed[rows]
        scheduled = split_budget(self.batch.num_tokens[rows] - computed, budget)
        need = self.batch.blocks_needed(rows, scheduled)
        total_need = int(need.sum())
        preempted = total_need > self.pool.num_free
        if preempted:
            rows, scheduled, need, new_block_ids = self._allocate_or_preempt(rows, scheduled, need)
            computed = self.batch.num_computed[rows]
        else:
            new_block_ids = self.pool.allocate(total_need)
        self.batch.extend_blocks(rows, need, new_block_ids)
        self.batch.num_computed[rows] = computed + scheduled
        return rows, scheduled, new_block_ids, preempted

    def update(self, result: StepResult) -> EngineOutputs:
        """Raises FrameError, changing nothing, for a result that does not fit the step."""
        if not self._in_flight or result.step != self.step:
            raise FrameError(f"result for step {result.step}; step {self.step} is in flight")
        batch = self.batch
        rows = batch.order
        computed = batch.num_computed[rows]
        known = batch.num_tokens[rows]
        caught_up = computed == known
        sampling = rows[caught_up]
        sampled = unpack_ids(result.sampled)
        if len(sampled) != len(sampling):
            raise FrameError(f"{len(sampled)} sampled ids for {len(sampling)} sampling rows")
        if len(sampled) and not (sampled.min() >= 0 and sampled.max() < self.vocab_size):
            raise FrameError(f"sampled ids outside the vocabulary [0, {self.vocab_size})")
        if result.logprobs and len(result.logprobs) != len(sampled):
            raise FrameError(f"{len(result.logprobs)} logprobs entries for {len(sampled)} ids")
        self._in_flight = False
        length = known[caught_up] + 1
        batch.tokens[sampling, length - 1] = sampled
        batch.num_tokens[sampling] = length
        if self.pool.enable_caching:
            for slot in self._prefilling:
                self.prefix_cache.publish(slot)
        token_ids, logprobs = result.sampled, result.logprobs
        if self._padding:  # padding rows' tokens are computed, never answered
            live = ~np.isin(sampling, list(self._padding))
            sampling, sampled, length = sampling[live], sampled[live], length[live]
            token_ids = pack_ids(sampled)
            logprobs = [entry for entry, keep in zip(logprobs, live, strict=False) if keep]
        self.stats.generation_tokens += len(sampled)
        req_ids = batch.req_ids[sampling]
        by_eos = sampled == batch.eos_token_id[sampling]
        ended = by_eos | (length >= batch.stop_len[sampling])
        if batch.num_with_stop_ids:
            for i in np.flatnonzero(batch.has_stop_ids[sampling]).tolist():
                by_eos[i] |= int(sampled[i]) in self.requests[int(req_ids[i])].stop_token_ids
            ended |= by_eos
        for i in np.flatnonzero(ended).tolist():
            self._finish_row(int(sampling[i]), "stop" if by_eos[i] else "length")
        for req_id in self._pending_aborts:
            self.abort(req_id)
        self._pending_aborts = []
        self._retire_padding()
        return EngineOutputs(
            step=self.step,
            req_ids=pack_ids(req_ids),
            token_ids=token_ids,
            finished=self.take_finished(),
            logprobs=logprobs,
        )

    def _admit(self, budget: int, prefilling: bool) -> list[NewRequest]:
        new: list[NewRequest] = []
        block_size = self.config.block_size
        queue = self._admission_queue(prefilling)
        while budget > 0 and len(self.batch) < self.config.max_num_seqs:
            req = queue.peek()
            if req is None:
                break
            cached = self.prefix_cache.lookup(req)
            num_cached = len(cached) * block_size
            count = min(len(req.token_ids) - num_cached, budget)
            need = cdiv(num_cached + count, block_size) - len(cached)
            idle_cached = sum(1 for block in cached if self.pool.ref_count[block] == 0)
            if need + idle_cached > self.pool.num_free:
                break
            queue.pop()
            self.pool.share(cached)
            blocks = cached + self.pool.allocate(need).tolist()
            slot = self.batch.admit(req, blocks, num_cached, self.by_priority)
            self.batch.last_hash[slot] = req.block_hashes[len(cached) - 1] if cached else 0
            self.batch.num_computed[slot] += count
            self.stats.prefix_cache_queries += len(req.token_ids)
            self.stats.prefix_cache_hits += num_cached
            new.append(
                NewRequest(
                    req_id=req.req_id,
                    token_ids=pack_ids(req.token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_computed=num_cached,
                    num_scheduled=count,
                    block_ids=pack_ids(blocks),
                    sampling=req.sampling,
                )
            )
            budget -= count
            if queue is self.suspects:
                break  # its prompt computes alone: a failure of this step names it
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
                self._preempt(int(rows[dropped[-1]]))
            if count > self.pool.num_free:
                dropped.append(pending.pop())
                self._preempt(int(rows[position]))
                break
            granted[position] = self.pool.allocate(count)
            served += 1
        keep = np.ones(len(rows), dtype=bool)
        keep[dropped] = False
        new_ids = [granted[p] for p in np.flatnonzero(keep).tolist()]
        new_ids = np.concatenate(new_ids) if new_ids else np.empty(0, dtype=np.int64)
        return rows[keep], scheduled[keep], need[keep], new_ids

    def _preempt_for_higher_priority(self, budget: int) -> None:
        """Preempt lower-priority running rows while the best waiting request cannot get in."""
        batch = self.batch
        while (head := self.waiting.peek()) is not None and len(batch):
            rows = batch.order
            worst = int(rows[np.argmax(batch.rank[rows])])
            if head.rank(by_priority=True) >= batch.rank[worst]:
                return
            scheduled = split_budget(batch.num_tokens[rows] - batch.num_computed[rows], budget)
            room = budget - int(scheduled.sum())
            if room <= 0:
                return
            running_need = int(batch.blocks_needed(rows, scheduled).sum())
            head_need = cdiv(min(len(head.token_ids), room), self.config.block_size)
            if len(batch) < self.config.max_num_seqs and (
                self.pool.num_free - running_need >= head_need
            ):
                return
            self._preempt(worst)
