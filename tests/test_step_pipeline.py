"""The executor launches a step before the one in flight has ended: the new step's inputs take
that step's tokens on the device, and its answer goes out once it lands. The answers are those
of running each step to its end, on the real model; and through the real processes, a device
that takes its time answers every step, in order, in both scheduling modes."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq
from plan_ahead import answers, scheduler_for

from turnstile.bench.overlap_bench import simulated_stack
from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.simulated_executor import scripted_tokens
from turnstile.executor_svc.step_in_flight import Carry, ReadyStep
from turnstile.offline import OfflineEngine
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import (
    AddRequest,
    EngineOutputs,
    FromScheduler,
    Heartbeat,
    SamplingParams,
    SchedulerStatus,
    StepResult,
    pack_ids,
    unpack_ids,
)
from turnstile.shared.settings import build
from turnstile.shared.zmq_io import FrameCodec, make_socket

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11),
    SamplingParams(temperature=1.0, logprobs=3, seed=5),
    SamplingParams(temperature=0.7, seed=3),
]
PENALIZED = 4  # this request's rows read their tokens on the host: its steps wait for them


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(build(RunnerConfig, dtype="float32", num_blocks=96, max_num_seqs=4))


def _answers(runner: ModelRunner, pipelined: bool) -> list[StepResult]:
    """The executor either runs each plan to its end or launches it behind the one in flight."""
    requests = []
    # More requests than rows: a row freed while a step is in flight takes a new request.
    for i in range(9):
        sampling = PARAMS[i % 4] if i != PENALIZED else SamplingParams(repetition_penalty=1.3)
        prompt = list(range(200 + 50 * i, 200 + 50 * i + 3 + 7 * i))
        requests.append(
            AddRequest(req_id=i, prompt_ids=pack_ids(prompt), max_tokens=4 + 3 * (i % 4),
                       sampling=sampling, ignore_eos=True)
        )  # fmt: skip
    scheduler = scheduler_for(runner, requests, max_num_seqs=4, max_num_batched_tokens=40)
    if pipelined:
        return answers(scheduler, runner.launch)
    return answers(scheduler, lambda plan: ReadyStep(plan.step, runner.execute(plan)))


def test_a_step_launched_behind_another_answers_as_if_run_alone(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _answers(runner, pipelined=False)
    carried = []
    carry = runner._carry

    def counted(inputs: object) -> Carry | None:
        found = carry(inputs)  # type: ignore[arg-type]
        carried.append(0 if found is None else len(found.to))
        return found

    monkeypatch.setattr(runner, "_carry", counted)
    behind = _answers(runner, pipelined=True)
    assert behind == alone
    assert sum(carried) >= 30  # tokens that reached their step on the device
    assert carried.count(0) >= 3  # steps that waited (the penalty's) or had none to take
    assert any(answer.logprobs for answer in alone)


@pytest.mark.parametrize("ahead", [True, False], ids=["async", "lockstep"])
def test_a_device_that_takes_its_time_answers_every_step_in_order(ahead: bool) -> None:
    """A 2 ms step on a simulated device: the executor's loop wakes for each plan and each
    step's end, and every request gets exactly its scripted tokens."""
    info = read_model_info(embedded_model_path())
    wanted = {req_id: 4 + 3 * req_id for req_id in range(12)}
    got: dict[int, list[int]] = {req_id: [] for req_id in wanted}
    ended: set[int] = set()
    with simulated_stack(0.002, 4, ahead) as address:
        socket = make_socket(zmq.Context.instance(), zmq.DEALER, address, bind=False)
        codec: FrameCodec[FromScheduler] = FrameCodec(FromScheduler, "test.gateway")
        socket.send(codec.encode(Heartbeat(0)))
        sent, deadline = False, time.monotonic() + 120
        while len(ended) < len(wanted):
            assert time.monotonic() < deadline, "the requests never ended (no executor ready?)"
            assert socket.poll(30_000), "the stack stopped answering"
            message = codec.decode(socket.recv())
            if isinstance(message, SchedulerStatus) and message.ready and not sent:
                for req_id, count in wanted.items():
                    sampling = SamplingParams(temperature=1.0, seed=1000 + req_id)
                    request = AddRequest(req_id, pack_ids([5, 6, 7]), count, sampling)
                    socket.send(codec.encode(request))
                sent = True
            elif isinstance(message, EngineOutputs):
                pairs = zip(unpack_ids(message.req_ids), unpack_ids(message.token_ids), strict=True)
                for req_id, token in pairs:
                    got[int(req_id)].append(int(token))
                ended |= {finished.req_id for finished in message.finished}
        socket.close(linger=0)
    for req_id, count in wanted.items():
        seeds = np.full(count, 1000 + req_id)
        script = scripted_tokens(seeds, np.arange(count), info.vocab_size, info.eos_token_id)
        assert got[req_id] == script.tolist()


def test_offline_generation_goes_a_step_ahead_and_gives_what_lockstep_gives() -> None:
    """`turnstile generate` and the offline benchmarks drive their runner as the async service
    does; a request that ends on a stop token while the next step is out loses that step's
    token, and the logprobs stay with their tokens."""
    engine = OfflineEngine(build(RunnerConfig, dtype="float32", num_blocks=64, max_num_seqs=4))
    assert engine.ahead == 2
    sampling = SamplingParams(logprobs=2)
    prompts = [list(range(300 + 40 * i, 310 + 40 * i + 5 * i)) for i in range(5)]
    plain = [
        AddRequest(i, pack_ids(p), 8, sampling, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    alone = engine.generate(plain[:1])[0].token_ids
    stop = alone[2]  # request 0's third token (or an earlier one, the same) ends it
    requests = [msgspec.structs.replace(plain[0], stop_token_ids=[stop]), *plain[1:]]
    carried = []
    carry = engine.runner._carry
    engine.runner._carry = lambda inputs: carried.append(carry(inputs)) or carried[-1]
    ahead = engine.generate(requests)
    assert sum(len(found.to) for found in carried if found is not None) >= 20
    engine.ahead = 1
    assert engine.generate(requests) == ahead
    assert ahead[0].finish_reason == "stop" and ahead[0].token_ids == alone[: alone.index(stop) + 1]
    assert all(len(done.logprobs) == len(done.token_ids) for done in ahead)
