"""The scheduler against what should never reach an executor: invalid requests, results that do
not fit their step, and requests whose steps kill their executor."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from scheduler_harness import VOCAB, Harness, expected_output

from turnstile.scheduler_svc.service import SchedulerService
from turnstile.scheduler_svc.service_config import SchedulerServiceConfig
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.model_info import served_name
from turnstile.shared.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    BatchPlan,
    Embedding,
    FrameError,
    Register,
    RegisterReply,
    SamplingParams,
    StepFailed,
    StepResult,
    pack_ids,
)
from turnstile.shared.settings import build


def config(**overrides: object) -> SchedulerConfig:
    values: dict[object, object] = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128
    )
    values.update(overrides)
    return build(SchedulerConfig, **values)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(prompt_ids=pack_ids([5, VOCAB])), "prompt token ids"),
        (dict(prompt_ids=pack_ids([-1, 5])), "prompt token ids"),
        (dict(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(priority=1 << 21), "priority"),
        (dict(sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (dict(sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (dict(sampling=SamplingParams(temperature=float("inf"))), "temperature"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(top_p=1.5)), "top_p"),
        (dict(sampling=SamplingParams(top_k=-2)), "top_k"),
        (dict(sampling=SamplingParams(logprobs=21)), "logprobs"),
        (dict(sampling=SamplingParams(logprobs=-1)), "logprobs"),
        (dict(sampling=SamplingParams(think_end=VOCAB)), "think_end"),
        (dict(sampling=SamplingParams(thinking_budget=4)), "thinking_budget"),
    ],
)
def test_every_field_an_executor_could_not_run_is_refused_by_name(
    change: dict[str, object], field: str
) -> None:
    harness = Harness(config(), {})
    valid = AddRequest(req_id=1, prompt_ids=pack_ids([5, 6]), max_tokens=4)
    harness.scheduler.add_request(valid)  # the same request, valid, is taken
    with pytest.raises(ValueError, match=field):
        harness.scheduler.add_request(msgspec.structs.replace(valid, req_id=2, **change))
    assert list(harness.scheduler.requests) == [1]


def test_a_result_that_does_not_fit_its_step_changes_nothing() -> None:
    harness = Harness(config(), {1: 10, 2: 10})
    harness.add(1, [5, 6, 7], max_tokens=10)
    harness.add(2, [8, 9], max_tokens=10)
    plan = harness.send()
    good = harness.executor.execute(plan)
    for bad in (
        StepResult(step=plan.step, sampled=pack_ids([5])),  # one id for two rows
        StepResult(step=plan.step, sampled=b"\x01\x02\x03"),  # not a whole id
        StepResult(step=plan.step, sampled=pack_ids([5, VOCAB])),  # outside the vocabulary
        StepResult(step=plan.step, sampled=good.sampled, logprobs=[[(1, -0.5)]]),
        # an embedding for a request that is not in the step
        StepResult(step=plan.step, sampled=good.sampled, embeddings=[Embedding(3, b"")]),
        StepResult(step=plan.step + 1, sampled=good.sampled),  # another step's
    ):
        with pytest.raises(FrameError):
            harness.scheduler.update(bad)
    harness._record(harness.scheduler.update(good))  # the real result still fits
    harness.run()
    assert harness.tokens[1] == expected_output(1, 10, 10)[0]


def crash_step(harness: Harness, why: str = "injected") -> None:
    """The step in flight kills its executor: the scheduler restarts on a fresh cache."""
    harness.scheduler.schedule()  # never computed: no mirror applies it
    harness.scheduler.restart(harness.scheduler.pool.num_blocks, failure=why)
    for ended in harness.scheduler.take_finished():
        harness.endings[ended.req_id].append(ended.reason)
    harness.replace_executor()


def test_a_request_that_kills_its_executor_twice_is_ended_and_the_others_finish() -> None:
    harness = Harness(config(), {1: 30, 2: 30, 3: 30, 4: 10})
    harness.add(1, [5, 6, 7], max_tokens=30)
    harness.add(2, [8, 9], max_tokens=30)
    for _ in range(3):
        harness.step()  # 1 and 2 decode
    harness.add(3, [10, 11, 12], max_tokens=30)  # the poison
    crash_step(harness, "IndexError in the embedding")
    assert [r.crashes for r in harness.scheduler.requests.values()] == [1, 1, 1]
    harness.add(4, [13, 14], max_tokens=10)  # arrives after the failure: no suspect
    # The suspects run one at a time, each computing its prompt with no other beside it.
    admitted: list[list[int]] = []
    while 3 not in {new.req_id for new in harness.plans[-1].new}:
        plan = harness.step()
        admitted.append([new.req_id for new in plan.new])
        suspects = [r for r in harness.scheduler.requests.values() if r.crashes]
        assert sum(r.status.value == "running" for r in suspects) <= 1
    assert [ids for ids in admitted if ids] == [[1], [4], [2], [3]]
    crash_step(harness, "IndexError again")  # the poison's step fails again
    assert harness.endings[3] == ["failed"] and 3 not in harness.scheduler.requests
    harness.run()
    for req_id in (1, 2):
        assert harness.tokens[req_id] == expected_output(req_id, 30, 30)[0]
        assert harness.endings[req_id] == ["stop"]
    assert harness.scheduler.pool.num_free == harness.scheduler.pool.num_blocks


def test_an_innocent_suspect_runs_on_and_a_restart_without_failure_blames_nobody() -> None:
    harness = Harness(config(), {1: 12, 2: 12})
    harness.add(1, [5, 6, 7], max_tokens=12)
    harness.add(2, [8, 9], max_tokens=12)
    crash_step(harness)  # both were computing their prompts: both suspects
    assert len(harness.scheduler.suspects) == 2
    harness.scheduler.restart(harness.scheduler.pool.num_blocks)  # a replacement registers
    harness.replace_executor()
    assert all(r.crashes == 1 for r in harness.scheduler.requests.values())
    harness.run()
    assert harness.endings == {1: ["stop"], 2: ["stop"]}
    assert harness.tokens[1] == expected_output(1, 12, 12)[0]


def test_aborts_are_honoured_waiting_suspect_and_mid_step() -> None:
    harness = Harness(config(), {1: 30, 2: 30, 3: 30})
    for req_id in (1, 2, 3):
        harness.add(req_id, [5 + req_id, 6], max_tokens=30)
    crash_step(harness)
    harness.abort(1)  # a suspect
    harness.scheduler.restart(harness.scheduler.pool.num_blocks)
    harness.replace_executor()
    harness.step()
    harness.abort(2)  # waiting or running
    harness.abort(3)
    assert harness.endings == {1: ["abort"], 2: ["abort"], 3: ["abort"]}
    assert not harness.scheduler.has_work and harness.scheduler.num_waiting == 0


def test_a_failure_blames_the_rows_of_the_failed_step_not_those_planned_after_it() -> None:
    harness = Harness(config(), {1: 30, 2: 30, 3: 30})
    harness.add(1, [5, 6, 7], max_tokens=30)
    harness.add(2, [8, 9], max_tokens=30)
    for _ in range(3):
        harness.step()
    harness.send()  # the step that fails: 1 and 2 decode
    harness.add(3, [10, 11, 12], max_tokens=30)
    planned = harness.send()  # async: planned while that one runs; it never does
    assert [new.req_id for new in planned.new] == [3]
    harness.scheduler.restart(harness.scheduler.pool.num_blocks, failure="injected")
    crashes = {r.req_id: r.crashes for r in harness.scheduler.requests.values()}
    assert crashes == {1: 1, 2: 1, 3: 0}


def test_an_executor_that_fails_a_step_and_leaves_is_blamed_for_the_failure_it_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the next plan sent ahead, an executor answers step 1, reports step 2 failed and
    exits; step 1's answer makes room for plan 3, which finds the executor gone while its
    report waits unread. The report's cause is what the requests are told (a client's error
    says why), not that the executor could not take plan 3. The scheduler's own service,
    in this process, on real ZeroMQ sockets; the executor a socket of the test's."""
    executors = f"ipc://{tmp_path}/executors.sock"
    settings = build(
        SchedulerServiceConfig, scheduler_address=f"ipc://{tmp_path}/scheduler.sock",
        executors_address=executors, max_num_seqs=8,
    )  # fmt: skip
    service = SchedulerService(settings)
    executor = zmq.Context.instance().socket(zmq.DEALER)
    executor.connect(executors)
    info, engine = service.model, service.config.engine
    executor.send(msgspec.msgpack.encode(Register(
        PROTOCOL_VERSION, 0, served_name(engine.model_path), info.vocab_size, 64,
        engine.block_size, 8, info.max_model_len,
    )))  # fmt: skip
    deadline = time.monotonic() + 10
    while not service.ready:
        assert time.monotonic() < deadline, "the executor never registered"
        service._drain_executors()
    assert msgspec.msgpack.decode(executor.recv(), type=RegisterReply).accepted
    service.scheduler.add_request(AddRequest(req_id=1, prompt_ids=pack_ids([5, 6]), max_tokens=8))
    service._maybe_step()
    steps = [msgspec.msgpack.decode(executor.recv(), type=BatchPlan).step for _ in range(2)]
    executor.send(msgspec.msgpack.encode(StepResult(step=steps[0], sampled=pack_ids([7]))))
    executor.send(msgspec.msgpack.encode(StepFailed(step=steps[1], error="RuntimeError: boom")))
    executor.close(linger=1000)
    time.sleep(0.5)  # both messages wait at the scheduler; the executor's pipe is closed
    with caplog.at_level(logging.ERROR):
        service._drain_executors()
    lost = [r.getMessage() for r in caplog.records if "re-queueing" in r.getMessage()]
    assert lost == [f"executor rank 0 failed step {steps[1]}: RuntimeError: boom: re-queueing "
                    "1 running requests"]  # fmt: skip
    assert not service.ready
