from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import EOS, Harness, expected_output

from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids, unpack_ids
from turnstile.shared.settings import build


def config(**overrides: object) -> SchedulerConfig:
    values: dict[object, object] = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128
    )
    values.update(overrides)
    return build(SchedulerConfig, **values)


def scheduled_tokens(harness: Harness, plan_index: int) -> int:
    """Tokens a plan computes, as the executor counts them."""
    plan = harness.plans[plan_index]
    mirror = harness.executor.applier.batch
    return (
        sum(new.num_scheduled for new in plan.new)
        + (len(mirror.order) - len(plan.new) - len(unpack_ids(plan.override_ids)))
        + int(unpack_ids(plan.override_counts).sum())
    )


def test_finished_prompt_prefix_is_reused_block_for_block() -> None:
    harness = Harness(config(), {1: 3, 2: 3})
    shared = list(range(10, 22))  # three full blocks of four
    harness.add(1, [*shared, 50, 51], max_tokens=8)
    harness.run()
    stats = harness.scheduler.stats
    assert (stats.prefix_cache_hits, stats.num_preemptions) == (0, 0)
    harness.add(2, [*shared, 60], max_tokens=8)
    plan = harness.step()
    (new,) = plan.new
    assert new.num_computed == 12
    first_blocks = unpack_ids(new.block_ids)[:3].tolist()
    harness.run()
    assert stats.prefix_cache_hits == 12
    assert harness.tokens[2] == expected_output(2, 3, 8)[0]
    # Request 2 got the very blocks request 1 wrote its first 12 tokens into.
    first_plan_blocks = unpack_ids(harness.plans[0].new[0].block_ids)[:3].tolist()
    assert first_blocks == first_plan_blocks


def test_prompts_prefilled_together_each_leave_their_whole_prompt_cached() -> None:
    """Two prompts of one shared block, computed in the same step: the second's copy of it is
    not cached, yet its own block after it must be, as the first's is."""
    harness = Harness(config(max_num_batched_tokens=32), {1: 2, 2: 2, 3: 2, 4: 2})
    shared = [10, 11, 12, 13]
    harness.add(1, [*shared, 20, 21, 22, 23, 9], max_tokens=2)
    harness.add(2, [*shared, 30, 31, 32, 33, 9], max_tokens=2)
    assert len(harness.step().new) == 2  # both prefill in one step
    harness.run()
    for req_id, own in ((3, [20, 21, 22, 23]), (4, [30, 31, 32, 33])):
        harness.add(req_id, [*shared, *own, 8], max_tokens=2)
        (new,) = harness.step().new
        assert new.num_computed == 8, req_id
        harness.run()


def test_whole_prompt_hit_still_computes_the_last_token() -> None:
    harness = Harness(config(), {1: 2, 2: 2})
    prompt = list(range(10, 18))  # exactly two blocks
    harness.add(1, prompt, max_tokens=4)
    harness.run()
    harness.add(2, prompt, max_tokens=4)
    (new,) = harness.step().new
    assert (new.num_computed, new.num_scheduled) == (4, 4)
    harness.run()
    assert harness.tokens[2] == expected_output(2, 2, 4)[0]


def test_chunked_prefill_stays_in_budget_and_never_starves_decodes() -> None:
    harness = Harness(config(max_num_batched_tokens=8, max_num_seqs=4), {1: 40, 2: 40, 3: 5})
    harness.add(1, [5, 6, 7], max_tokens=40)
    harness.add(2, [8, 9], max_tokens=40)
    harness.step()
    harness.step()
    long_prompt = list(range(100, 160))
    harness.add(3, long_prompt, max_tokens=5)
    start = len(harness.plans)
    before = {1: len(harness.tokens[1]), 2: len(harness.tokens[2])}
    while len(harness.tokens[3]) == 0:
        harness.step()
        harness.check_invariants()
    steps = len(harness.plans) - start
    assert all(scheduled_tokens(harness, i) <= 8 for i in range(len(harness.plans)))
    # The 60-token prompt took several chunked steps, and each of them still decoded 1 and 2.
    assert steps >= 60 // 8
    assert len(harness.tokens[1]) - before[1] == steps
    assert len(harness.tokens[2]) - before[2] == steps
    harness.run()
    assert harness.endings == {1: ["stop"], 2: ["stop"], 3: ["stop"]}


def test_abort_frees_blocks_at_once_even_mid_step_and_the_late_token_is_dropped() -> None:
    harness = Harness(config(), {1: 50, 2: 50})
    harness.add(1, list(range(3, 20)), max_tokens=50)
    harness.add(2, list(range(30, 40)), max_tokens=50)
    harness.step()
    harness.step()
    harness.abort(1)
    assert harness.endings[1] == ["abort"]
    harness.check_invariants()
    plan = harness.send()
    harness.scheduler.abort(2)  # the executor is computing request 2 right now
    assert [ended.reason for ended in harness.scheduler.take_finished()] == ["abort"]
    # Free at once: the next plan removes the row before any other row can be given them.
    assert harness.scheduler.pool.num_free == harness.scheduler.pool.num_blocks
    assert harness.scheduler.rows_leaving_with_next_plan == [2]
    outputs = harness.scheduler.update(harness.executor.execute(plan))
    assert len(unpack_ids(outputs.token_ids)) == 0 and not outputs.finished
    assert not harness.scheduler.has_work


def test_preemption_by_recompute_loses_nothing() -> None:
    lengths = {i: 20 for i in range(4)}
    harness = Harness(config(num_blocks=12, max_num_seqs=4), lengths)
    for i in range(4):
        harness.add(i, [10 + i] * 6, max_tokens=30)
    harness.run()
    assert harness.scheduler.stats.num_preemptions > 0
    for i in range(4):
        assert (harness.tokens[i], harness.endings[i]) == (
            expected_output(i, 20, 30)[0],
            ["stop"],
        )


def test_higher_priority_arrival_preempts_a_running_lower_priority_request() -> None:
    lengths = {1: 30, 2: 30, 3: 4}
    harness = Harness(config(num_blocks=16, max_num_seqs=2, policy="priority"), lengths)
    harness.add(1, list(range(3, 11)), max_tokens=30, priority=5)
    harness.add(2, list(range(20, 28)), max_tokens=30, priority=1)
    for _ in range(3):
        harness.step()
    harness.add(3, list(range(40, 48)), max_tokens=4, priority=0)
    plan = harness.step()
    assert 1 in unpack_ids(plan.removed).tolist()
    assert [new.req_id for new in plan.new] == [3]
    harness.run()
    assert harness.scheduler.stats.num_preemptions >= 1
    assert list(harness.endings) == [3, 2, 1]
    for req_id, length in lengths.items():
        assert harness.tokens[req_id] == expected_output(req_id, length, 30)[0]


def test_stop_token_ids_max_tokens_and_context_end_requests() -> None:
    lengths = {1: 50, 2: 50, 3: 50}
    harness = Harness(config(max_model_len=24), lengths)
    stop_at = expected_output(1, 50, 50)[0][4]
    harness.add(1, [5, 6, 7], max_tokens=40, stop_token_ids=(stop_at,))
    harness.add(2, [5, 6, 7], max_tokens=6)
    harness.add(3, [8] * 20, max_tokens=40)
    harness.run()
    assert (
        harness.tokens[1] == expected_output(1, 50, 50)[0][: harness.tokens[1].index(stop_at) + 1]
    )
    assert harness.endings[1] == ["stop"]
    assert (len(harness.tokens[2]), harness.endings[2]) == (6, ["length"])
    assert (len(harness.tokens[3]), harness.endings[3]) == (4, ["length"])


@pytest.mark.parametrize("ahead", [0, 1])
def test_every_eos_id_of_the_model_ends_a_request_unless_it_ignores_eos(ahead: int) -> None:
    """Llama 3.x ends at any of several ids (config.json's list, generation_config.json's)."""
    other_eos = expected_output(1, 50, 50)[0][3]
    harness = Harness(config(), {1: 50}, ahead, eos_token_ids=(EOS, other_eos))
    harness.add(1, [5, 6, 7], max_tokens=40)
    harness.add(2, [5, 6, 7], max_tokens=10, ignore_eos=True)
    harness.scheduler.requests[2].sampling = SamplingParams(seed=1)  # request 1's script
    harness.run()
    assert (harness.tokens[1], harness.endings[1]) == (expected_output(1, 50, 50)[0][:4], ["stop"])
    assert (len(harness.tokens[2]), harness.endings[2]) == (10, ["length"])


def test_ignore_eos_runs_to_max_tokens() -> None:
    harness = Harness(config(), {1: 3})
    harness.add(1, [5, 6], max_tokens=7, ignore_eos=True)
    harness.run()
    assert harness.tokens[1][2] == EOS
    assert (len(harness.tokens[1]), harness.endings[1]) == (7, ["length"])


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 4, "between 1 and"),
        (list(range(3, 200)), 4, "context is 128"),
        ([5, 6], 0, "max_tokens"),
        (list(range(3, 100)), 28, "KV cache"),
    ],
)
def test_requests_that_can_never_run_are_refused_and_leave_nothing(
    prompt: list[int], max_tokens: int, message: str
) -> None:
    harness = Harness(config(num_blocks=30), {})
    with pytest.raises(ValueError, match=message):
        harness.add(7, prompt, max_tokens=max_tokens)
    assert not harness.scheduler.has_work
    assert len(harness.scheduler.waiting) == 0


def test_duplicate_request_id_is_refused() -> None:
    harness = Harness(config(), {1: 3})
    harness.add(1, [5], max_tokens=3)
    with pytest.raises(ValueError, match="already in use"):
        harness.add(1, [6], max_tokens=3)


def test_steady_decode_plan_is_a_few_bytes_plus_new_blocks() -> None:
    import msgspec

    harness = Harness(
        config(max_num_seqs=16, num_blocks=400, max_num_batched_tokens=512),
        {i: 10**6 for i in range(16)},
    )
    for i in range(16):
        harness.add(i, list(range(3, 8 + i)), max_tokens=100)
    for _ in range(3):
        harness.step()
    for _ in range(20):
        plan = harness.step()
        size = len(msgspec.msgpack.encode(plan))
        assert plan.new == [] and plan.override_ids == b""
        assert size <= 17 + 4 * len(unpack_ids(plan.new_block_ids))
    assert np.all(harness.scheduler.batch.num_tokens[harness.scheduler.batch.order] > 8)


@pytest.mark.parametrize("mode", ["padded", "compact"])
def test_static_batching_admits_a_new_batch_only_when_the_last_is_done(mode: str) -> None:
    lengths = {0: 3, 1: 9, 2: 2, 3: 2}
    harness = Harness(config(max_num_seqs=2, static_batching=mode), lengths)
    for i in range(4):
        harness.add(i, [5, 6, 7], max_tokens=20)
    admitted_at, rows_per_step = {}, []
    while harness.scheduler.has_work:
        plan = harness.step()
        harness.check_invariants()
        rows_per_step.append(len(harness.executor.applier.batch))  # rows this step computed
        for new in plan.new:
            admitted_at[new.req_id] = len(harness.plans)
    # Requests 2 and 3 wait for the whole first batch, the 9-token request 1 included.
    assert admitted_at[0] == admitted_at[1] == 1
    assert admitted_at[2] == admitted_at[3] == 1 + 9  # the step after request 1 ends
    # Every request answers exactly its own tokens, padded or not.
    assert {i: len(tokens) for i, tokens in harness.tokens.items()} == lengths
    assert harness.endings == {i: ["stop"] for i in lengths}
    assert harness.scheduler.pool.num_free == harness.scheduler.pool.num_blocks
    # Padded: request 0 computes on beside request 1 (2 rows for all 9 steps); compact: it
    # leaves after its 3 tokens.
    first_batch = rows_per_step[:9]
    assert first_batch == ([2] * 9 if mode == "padded" else [2, 2, 2] + [1] * 6)


def test_an_abort_in_a_padded_static_batch_frees_its_padding_rows() -> None:
    harness = Harness(config(max_num_seqs=3, static_batching="padded"), {0: 2, 1: 30, 2: 2})
    for i in range(3):
        harness.add(i, [5, 6, 7], max_tokens=40)
    for _ in range(4):
        harness.step()
    assert len(harness.scheduler.batch) == 3  # two of them padding
    harness.abort(1)
    harness.check_invariants()
    assert len(harness.scheduler.batch) == 0 and not harness.scheduler.has_work
    assert harness.scheduler.pool.num_free == harness.scheduler.pool.num_blocks


def test_queue_deadline_ends_only_requests_that_never_ran() -> None:
    harness = Harness(config(max_num_seqs=1), {1: 30, 2: 30, 3: 30})
    harness.scheduler.add_request(_message(1), now=0.0)
    harness.step()  # request 1 runs
    harness.scheduler.add_request(_message(2), now=1.0)
    harness.scheduler.add_request(_message(3), now=4.0)
    harness.scheduler.expire_waiting(now=6.5, max_wait=5.0)
    ended = {f.req_id: (f.reason, f.error) for f in harness.scheduler.take_finished()}
    assert list(ended) == [2] and ended[2][0] == "overloaded" and "5 s" in ended[2][1]
    harness.run()
    assert harness.endings == {1: ["stop"], 3: ["stop"]}
    harness.check_invariants()


def _message(req_id: int) -> AddRequest:
    return AddRequest(req_id=req_id, prompt_ids=pack_ids([5, 6, 7]), max_tokens=30,
                      sampling=SamplingParams(seed=req_id))  # fmt: skip
