"""A request's life in the scheduler: it enters (or is refused), waits, runs, is preempted
and resumes, and ends exactly once (finished, aborted, expired or failed), its blocks freed.
`Scheduler` (scheduler.py) holds one and plans each step over it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from turnstile.scheduler_svc.admission import admission_for
from turnstile.scheduler_svc.block_pool import BlockPool
from turnstile.scheduler_svc.in_flight import StepInFlight
from turnstile.scheduler_svc.prefix_cache import PrefixCache
from turnstile.scheduler_svc.request import Request, Status, context_limit
from turnstile.scheduler_svc.running_batch import RunningBatch
from turnstile.scheduler_svc.waiting_queue import FcfsQueue, PriorityQueue
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import AddRequest, Finished


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0  # rows' steps with drafts (speculative decoding)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0  # drafts that stood


class RequestLifecycle:
    def __init__(
        self, config: SchedulerConfig, eos_token_ids: tuple[int, ...], vocab_size: int
    ) -> None:
        self.config = config
        # Every id that ends generation (Llama 3.x has several: config.json's and
        # generation_config.json's), for every request that does not ignore EOS.
        self.eos_token_ids = np.array(eos_token_ids, dtype=np.int32)
        self.eos_set = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.by_priority = config.scheduling.policy == "priority"
        self.admission = admission_for(config)
        self.pool = BlockPool(config.num_blocks, config.block_size, config.prefix_caching)
        self.batch = RunningBatch(config.max_num_seqs, config.max_model_len, config.block_size)
        self.prefix_cache = PrefixCache(self.pool, self.batch)
        self.waiting = PriorityQueue() if self.by_priority else FcfsQueue()
        # Requests that were computing their prompt when an executor failed: they run one at a
        # time, so a second failure names the one that causes it.
        self.suspects = FcfsQueue()
        self.requests: dict[int, Request] = {}
        self.stats = SchedulerStats()
        self._arrivals = 0
        self.in_flight: deque[StepInFlight] = deque()  # planned, oldest first, not answered
        self._removed: list[int] = []
        self._finished: list[Finished] = []
        # Static "padded" batching: rows whose request has ended but which compute on, their
        # tokens discarded, until the last live row of their batch is done.
        self.padding: set[int] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.suspects)

    @property
    def rows_leaving_with_next_plan(self) -> list[int]:
        """Requests that left the batch since the last plan; the executor still holds them."""
        return list(self._removed)

    def add_request(self, msg: AddRequest, now: float = 0.0) -> None:
        """Queue a request; raises ValueError (and keeps nothing) when it can never run."""
        cfg = self.config
        if msg.req_id in self.requests:
            raise ValueError(f"request id {msg.req_id} is already in use")
        req = Request.from_message(
            msg, self._arrivals, cfg.max_model_len, self.vocab_size, cfg.enable_lora,
            cfg.max_logprobs,
        )  # fmt: skip
        if req.priority and not self.by_priority:
            raise ValueError("priority needs the priority policy (serve with --policy priority)")
        longest = context_limit(req.sampling, cfg.max_model_len) - 1
        if not 0 < req.num_prompt_tokens <= longest:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; it must have between 1 and "
                f"{longest} (the model's context is {cfg.max_model_len})"
            )
        if cfg.blocks_held(req.stop_len - 1) > cfg.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {cfg.blocks_held(req.stop_len - 1)} blocks "
                f"({cfg.block_size} tokens each) of KV cache; it holds {cfg.num_blocks}"
            )
        self._arrivals += 1
        req.arrived_at = now
        self.requests[req.req_id] = req
        self.waiting.push(req)
        self.stats.prompt_tokens += req.num_prompt_tokens

    def abort(self, req_id: int) -> None:
        """End a request now (a token of it still in flight is dropped on arrival); unknown ids
        are ignored."""
        req = self.requests.get(req_id)
        if req is None:
            return
        self.leave(req, "abort")
        self.retire_padding()

    def restart(self, num_blocks: int, failure: str = "") -> None:
        """The executors' KV cache is gone (an executor died or was replaced): every running
        request goes back to the front of the waiting queue with its tokens, to be recomputed,
        and the block pool and prefix cache start empty.

        With a `failure` (the executor died running the step in flight), that step's rows
        become suspects: they run one at a time, each computing its prompt with no other beside
        it, so a second failure names its cause, and a request in two failed steps ends as
        "failed": a request that kills its executor cannot take the service down."""
        if failure and self.in_flight:
            self._blame(failure)
        for record in self.in_flight:
            record.forget_drafts(self.batch)
        slots = self.batch.order.tolist()
        released = [self.batch.release(slot, keep_tokens=True)[0] for slot in slots]
        running = [req for req in released if req.status is Status.RUNNING]
        self.stats.num_preemptions += len(running)
        self.padding = set()
        self.pool = BlockPool(num_blocks, self.config.block_size, self.config.prefix_caching)
        self.batch = RunningBatch(
            self.config.max_num_seqs, self.config.max_model_len, self.config.block_size
        )
        self.prefix_cache = PrefixCache(self.pool, self.batch)
        for req in sorted(running, key=lambda r: r.rank(self.by_priority), reverse=True):
            req.status = Status.WAITING
            req.num_preemptions += 1
            self._queue_of(req).push_front(req)
        self._removed = []
        self.in_flight.clear()

    def fail_all(self, error: str) -> None:
        """End every live request as "unavailable" (after `restart`, none is running)."""
        for req in list(self.requests.values()):
            self.leave(req, "unavailable", error)

    def expire_waiting(self, now: float, max_wait: float) -> None:
        """End, as "overloaded", requests that have waited more than `max_wait` without ever
        running (a preempted request has started answering and is kept)."""
        for req in list(self.requests.values()):
            stale = now - req.arrived_at > max_wait
            if stale and req.status is Status.WAITING and req.num_preemptions == 0:
                self.leave(req, "overloaded", f"waited more than {max_wait:g} s in the queue")

    def take_removed(self) -> list[int]:
        """Rows that left since the last plan, for the next one to remove."""
        removed, self._removed = self._removed, []
        return removed

    def take_finished(self) -> list[Finished]:
        """Endings that happened outside a step (aborts), for the caller to report."""
        finished, self._finished = self._finished, []
        return finished

    def preempt(self, slot: int) -> None:
        if slot in self.padding:
            self._drop_row(slot, keep_tokens=False)
            return
        req = self._drop_row(slot, keep_tokens=True)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self._queue_of(req).push_front(req)
        self.stats.num_preemptions += 1

    def _queue_of(self, req: Request) -> FcfsQueue | PriorityQueue:
        return self.suspects if req.crashes else self.waiting

    def _blame(self, failure: str) -> None:
        """Every row of the failed step (the oldest in flight) still running is one failure
        closer to being ended; rows planned only in later steps never ran."""
        for slot in self.in_flight[0].still_rows(self.batch):
            req = self.batch.requests[slot]
            if req is None or req.status is not Status.RUNNING:
                continue  # padding of a static batch: already ended
            req.crashes += 1
            if req.crashes >= 2:
                error = f"its executor failed twice while computing it; last: {failure}"
                self.leave(req, "failed", error)

    def leave(self, req: Request, reason: str, error: str = "", publish: bool = True) -> None:
        """End a live request wherever it is: its row dropped (its full blocks cached unless
        not `publish`), or out of its queue."""
        if req.status is Status.RUNNING:
            self._drop_row(self.batch.slot_of[req.req_id], keep_tokens=False, publish=publish)
        else:
            self._queue_of(req).discard(req)
        self._end(req, reason, error)

    def _drop_row(self, slot: int, keep_tokens: bool, publish: bool = True) -> Request:
        if self.pool.enable_caching and publish:
            self.prefix_cache.publish(slot)
        req, blocks = self.batch.release(slot, keep_tokens)
        self.pool.release(blocks)
        self._removed.append(req.req_id)
        self.padding.discard(slot)
        return req

    def finish_row(self, slot: int, reason: str) -> None:
        if self.admission.pads_finished_rows:
            self._end(self.batch.requests[slot], reason)  # type: ignore[arg-type]
            self.padding.add(slot)
            self.batch.stop_len[slot] = self.config.max_model_len  # it computes on
        else:
            self._end(self._drop_row(slot, keep_tokens=False), reason)

    def retire_padding(self) -> None:
        """Padding rows leave together once no live row is left in their batch, or one by one
        at the model's context limit."""
        if not self.padding:
            return
        batch_done = len(self.padding) == len(self.batch)
        for slot in list(self.padding):
            if batch_done or self.batch.num_tokens[slot] >= self.config.max_model_len - 1:
                self._drop_row(slot, keep_tokens=False)

    def _end(self, req: Request, reason: str, error: str = "") -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self.requests[req.req_id]
        self._finished.append(Finished(req.req_id, reason, error, req.cached_tokens or 0))
