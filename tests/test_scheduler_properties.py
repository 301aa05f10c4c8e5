"""Stateful property test: random arrivals, aborts, priorities and lengths on a KV cache small
enough to force preemption; the invariants hold after every step and nothing is ever lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_harness import Harness, expected_output

from turnstile.shared.config import SchedulerConfig
from turnstile.shared.settings import build

PREFIXES = [list(range(100, 112)), list(range(200, 208))]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lengths: dict[int, int] = {}
        self.limits: dict[int, int] = {}
        self.refused: set[int] = set()
        self.aborted: set[int] = set()
        self.next_id = 0

    @initialize(
        policy=st.sampled_from(["fcfs", "priority"]),
        block_size=st.sampled_from([2, 4, 16]),
        blocks_of_tokens=st.integers(24, 64),
        max_num_seqs=st.integers(1, 5),
        extra_budget=st.integers(0, 20),
        caching=st.booleans(),
        static=st.sampled_from([None, None, "padded", "compact"]),
        ahead=st.sampled_from([0, 1]),
        window=st.sampled_from([0, 0, 5, 12]),
    )
    def configure(
        self,
        policy: str,
        block_size: int,
        blocks_of_tokens: int,
        max_num_seqs: int,
        extra_budget: int,
        caching: bool,
        static: str | None,
        ahead: int,
        window: int,
    ) -> None:
        self.config = build(
            SchedulerConfig,
            num_blocks=max(2, blocks_of_tokens // block_size + 1),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            max_model_len=48,
            policy=policy,  # type: ignore[arg-type]
            enable_prefix_caching=caching,
            static_batching=static,  # type: ignore[arg-type]
            sliding_window=window,
        )
        self.harness = Harness(self.config, self.lengths, ahead)

    @rule(
        prefix=st.sampled_from([[], *PREFIXES]),
        tail=st.lists(st.integers(3, 999), min_size=1, max_size=14),
        max_tokens=st.integers(1, 30),
        script_len=st.integers(1, 30),
        priority=st.integers(0, 3),
        ignore_eos=st.booleans(),
    )
    def arrive(
        self,
        prefix: list[int],
        tail: list[int],
        max_tokens: int,
        script_len: int,
        priority: int,
        ignore_eos: bool,
    ) -> None:
        req_id, self.next_id = self.next_id, self.next_id + 1
        prompt = prefix + tail
        self.lengths[req_id] = 10**6 if ignore_eos else script_len
        self.limits[req_id] = min(max_tokens, self.config.max_model_len - len(prompt))
        try:
            by_priority = self.config.scheduling.policy == "priority"  # fcfs refuses one
            self.harness.add(req_id, prompt, max_tokens, priority * by_priority, ignore_eos)
        except ValueError:
            self.refused.add(req_id)

    @precondition(lambda self: self.harness.scheduler.has_work or self.harness.sent)
    @rule(count=st.integers(1, 4))
    def step(self, count: int) -> None:
        for _ in range(count):
            if self.harness.scheduler.has_work or self.harness.sent:
                self.harness.step()

    @precondition(lambda self: self.harness.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.harness.scheduler.requests)))
        self.harness.abort(req_id)
        self.aborted.add(req_id)

    @invariant()
    def accounting_holds(self) -> None:
        if hasattr(self, "harness"):
            self.harness.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "harness"):
            return
        harness = self.harness
        harness.run(max_steps=5_000)
        assert harness.scheduler.pool.num_free == self.config.num_blocks
        for req_id in range(self.next_id):
            if req_id in self.refused:
                assert req_id not in harness.endings and req_id not in harness.tokens
                continue
            assert len(harness.endings[req_id]) == 1, (req_id, harness.endings[req_id])
            tokens, reason = expected_output(req_id, self.lengths[req_id], self.limits[req_id])
            if harness.endings[req_id] == ["abort"]:
                assert req_id in self.aborted
                assert harness.tokens[req_id] == tokens[: len(harness.tokens[req_id])]
            else:
                assert (harness.tokens[req_id], harness.endings[req_id]) == (tokens, [reason])


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
test_scheduler_state_machine = SchedulerMachine.TestCase


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@given(seed=st.integers(0, 2**16))
@settings(max_examples=25)
def test_preemption_happens_under_pressure_and_outputs_stay_exact(
    policy: str, ahead: int, seed: int
) -> None:
    """The machine above can pass without preempting; this one always needs to."""
    lengths = {i: 12 + (seed + i) % 9 for i in range(6)}
    harness = Harness(
        build(
            SchedulerConfig,
            num_blocks=10,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=8,
            max_model_len=40,
            policy=policy,  # type: ignore[arg-type]
        ),
        lengths,
        ahead,
    )
    for i in range(6):
        priority = i % 3 if policy == "priority" else 0  # fcfs refuses a priority
        harness.add(i, [3 + (seed + i) % 50] * (5 + i % 3), max_tokens=30, priority=priority)
    harness.run()
    assert harness.scheduler.stats.num_preemptions > 0
    for i in range(6):
        assert (harness.tokens[i], harness.endings[i]) == (
            expected_output(i, lengths[i], 30)[0],
            ["stop"],
        )


@pytest.mark.parametrize("ahead", [0, 1])
def test_blocks_given_back_behind_a_window_are_never_published(ahead: int) -> None:
    """Found by the machine above: a row that had given blocks back behind its sliding window
    later published them, by then another request's (a prefix lookup would have handed a
    later request that one's KV) or blank (the next hit broke the pool). Request 0 decodes
    past its window, request 1 takes the blocks it gave back, request 2 repeats 0's prompt."""
    config = build(SchedulerConfig, num_blocks=12, block_size=2, max_num_seqs=2,
                   max_num_batched_tokens=8, max_model_len=48, enable_prefix_caching=True,
                   sliding_window=5)  # fmt: skip
    harness = Harness(config, {0: 12, 1: 12, 2: 4}, ahead)
    prompt = [*range(200, 208), 3]
    harness.add(0, prompt, max_tokens=12)
    for _ in range(6):
        harness.step()
        harness.check_invariants()
    harness.add(1, list(range(500, 509)), max_tokens=12)
    harness.run()
    harness.add(2, prompt, max_tokens=12)
    harness.run()
    assert harness.scheduler.pool.num_free == config.num_blocks
    for req_id, length in ((0, 12), (1, 12), (2, 4)):
        tokens, reason = expected_output(req_id, length, 12)
        assert (harness.tokens[req_id], harness.endings[req_id]) == (tokens, [reason])
