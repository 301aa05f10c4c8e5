"""Iteration-level scheduling: one token budget a step, running requests first, then waiting ones.

`schedule()` builds the next `BatchPlan`; `update()` takes the executor's `StepResult` for the
oldest step in flight, fills in the sampled tokens, ends requests that hit a stop condition and
returns their `EngineOutputs`. The next step may be planned before the last one's result is
back (async scheduling): the stops it reveals then take effect one step later.
Steady decode is vector arithmetic over the running batch; Python loops only run over events
(a new block, an admission, an ending, a preemption).
"""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.in_flight import StepInFlight
from turnstile.scheduler_svc.lifecycle import RequestLifecycle
from turnstile.scheduler_svc.request import Status
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
        """Whether to step now: there is work, and the admission policy does not wait."""
        if not self.has_work:
            return False
        first = self.waiting.peek()
        waited = None if first is None else now - first.arrived_at
        return self.admission.wants_step(len(self.batch), self.num_waiting, waited)

    def schedule(self) -> BatchPlan:
        self.step += 1
        budget = self.config.scheduling.max_num_batched_tokens
        if self.by_priority:
            self._preempt_for_higher_priority(budget)
        rows = self.batch.order
        steady = bool((self.batch.wanted(rows) == 1).all())
        new_block_ids = self._schedule_decodes(rows) if steady else None
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
        closed = preempted or not self.admission.is_open(len(rows))
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
        admitted = [self.batch.slot_of[n.req_id] for n in new]
        prefilled = np.concatenate([rows[overridden], np.array(admitted, dtype=np.int64)])
        self.in_flight.append(StepInFlight.record(self.step, self.batch, prefilled))
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
        self, rows: np.ndarray, budget: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Any step: split the budget, grant blocks, preempt when they run out."""
        computed = self.batch.num_computed[rows]
        scheduled = split_budget(self.batch.wanted(rows), budget)
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
        record = self.in_flight[0] if self.in_flight else None
        if record is None or result.step != record.step:
            raise FrameError(f"result for step {result.step}; step {self.step} is the latest sent")
        sampled = unpack_ids(result.sampled)
        if len(sampled) != len(record.slots):
            raise FrameError(f"{len(sampled)} sampled ids for {len(record.slots)} sampling rows")
        if len(sampled) and not (sampled.min() >= 0 and sampled.max() < self.vocab_size):
            raise FrameError(f"sampled ids outside the vocabulary [0, {self.vocab_size})")
        if result.logprobs and len(result.logprobs) != len(sampled):
            raise FrameError(f"{len(result.logprobs)} logprobs entries for {len(sampled)} ids")
        self.in_flight.popleft()
        batch = self.batch
        live = record.live(batch)
        batch.fill_places(record.slots[live], record.index[live], sampled[live])
        if self.pool.enable_caching:
            for slot in record.still_prefilled(batch):
                self.prefix_cache.publish(slot)
        answered = live.copy()
        if self._padding:  # padding rows' tokens are computed, never answered
            answered &= ~np.isin(record.slots, list(self._padding))
        rows = np.flatnonzero(answered)
        for i in np.flatnonzero(~live).tolist():
            answered[i] = self._late_token(record, i, int(sampled[i]))
        kept = np.flatnonzero(answered)
        self.stats.generation_tokens += len(kept)
        self._end_stopped(record.slots[rows], sampled[rows], record.index[rows] + 1)
        self._retire_padding()
        return EngineOutputs(
            step=result.step,
            req_ids=pack_ids(record.req_ids[kept]),
            token_ids=pack_ids(sampled[kept]),
            finished=self.take_finished(),
            logprobs=[result.logprobs[i] for i in kept.tolist()] if result.logprobs else [],
        )

    def _end_stopped(self, slots: np.ndarray, sampled: np.ndarray, length: np.ndarray) -> None:
        """End the rows whose new token is EOS or a stop token id, or reaches their length."""
        batch = self.batch
        eos = self.eos_token_ids
        by_eos = (sampled == eos[0]) if len(eos) == 1 else np.isin(sampled, eos)
        by_eos &= batch.stops_at_eos[slots]
        ended = by_eos | (length >= batch.stop_len[slots])
        if batch.num_with_stop_ids:
            for i in np.flatnonzero(batch.has_stop_ids[slots]).tolist():
                request = batch.requests[int(slots[i])]
                by_eos[i] |= int(sampled[i]) in request.stop_token_ids  # type: ignore[union-attr]
            ended |= by_eos
        for i in np.flatnonzero(ended).tolist():
            self._finish_row(int(slots[i]), "stop" if by_eos[i] else "length")

    def _late_token(self, record: StepInFlight, i: int, token: int) -> bool:
        """A token for a row that left after its step was planned. It stands (and is answered)
        only for a request preempted meanwhile and not yet back: it joins the tokens the
        request resumes with, and may end it."""
        req = self.requests.get(int(record.req_ids[i]))
        if req is None or req.status is not Status.WAITING:
            return False
        if len(req.token_ids) != int(record.index[i]):
            return False
        req.token_ids = np.append(req.token_ids, np.int32(token))
        if (req.stops_at_eos and token in self.eos_set) or token in req.stop_token_ids:
            self._leave(req, "stop")
        elif len(req.token_ids) >= req.stop_len:
            self._leave(req, "length")
        return True

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
            scheduled = split_budget(batch.wanted(rows), budget)
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
