"""The CUDA backend's whole step, proven free of host tensors and host syncs without a GPU.

Torch's `meta` device stands in for the GPU: a meta tensor has a shape and no data, so an op
that mixes in a host tensor raises (as it would on CUDA), and so does anything that needs a
value on the host (`.item()`, `int(t)`, `.tolist()`, `nonzero`, a boolean mask): the syncs a
GPU step must not make. The Triton kernels run through their fake implementations
(`kernels/triton_ops.py`). `FakeTensorMode` with a fake "cuda:0" would catch the same, but this
CPU-only torch refuses even `x[1:3]` there. Real parts otherwise: the embedded model's weights,
the real scheduler's plans, the executor's plan applier, staging and sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.staging import Staging
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import AddRequest, Grammar, SamplingParams, StepResult, pack_ids
from turnstile.shared.settings import build

PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11),
    SamplingParams(temperature=1.0, logprobs=3),
    SamplingParams(logprobs=0),
    SamplingParams(temperature=0.7, seed=3, grammar=Grammar("regex", "(.|\n)*")),  # a mask
]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    config = build(
        RunnerConfig, dtype="bfloat16", device="meta", backend="cuda", num_blocks=64,
        max_num_seqs=8,
    )  # fmt: skip
    return ModelRunner(config)


def _steps(runner: ModelRunner) -> list[set[str]]:
    """Run the real scheduler's plans on meta until every request is done; the kinds of rows
    (prefill, decode) in each step."""
    scheduler = Scheduler(
        build(
            SchedulerConfig, num_blocks=runner.num_blocks, block_size=16, max_num_seqs=8,
            max_num_batched_tokens=24, max_model_len=runner.max_model_len,
        ),
        eos_token_ids=runner.info.all_eos_token_ids,
        vocab_size=runner.info.vocab_size,
    )  # fmt: skip
    runner.reset(1)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140)), [7, 8], list(range(300, 317)), [9] * 20]
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS, strict=True)):
        scheduler.add_request(
            AddRequest(req_id=i, prompt_ids=pack_ids(prompt), max_tokens=4, ignore_eos=True,
                       sampling=params)
        )  # fmt: skip
    kinds = []
    while scheduler.has_work:
        plan = scheduler.schedule()
        inputs = runner.applier.apply(plan)
        runner.follow_grammars(plan)
        step = runner.upload(inputs)
        constrained = runner.applier.batch.req_ids[inputs.sample_rows]
        sampled, _ = runner.run(step, constrained)
        assert sampled.tokens.device.type == "meta"
        assert sampled.tokens.shape == (len(inputs.sample_rows),)
        asking = sampled.asking
        if asking:
            assert sampled.logprobs is not None
            assert sampled.logprobs.shape == (len(asking), 1 + 2 * max(n for _, n in asking))
        lens = np.diff(inputs.query_start_loc)
        kinds.append({"decode" if n == 1 else "prefill" for n in lens})
        tokens = np.full(len(inputs.sample_rows), 42, dtype=np.int64)  # meta has no values
        runner.applier.commit(tokens)
        runner.grammars.accept(constrained, tokens)
        assert not runner.grammars.take_refused()
        scheduler.update(StepResult(step=plan.step, sampled=pack_ids(tokens)))
    return kinds


def test_a_whole_cuda_step_stays_on_the_device(runner: ModelRunner) -> None:
    assert runner.backend.name == "cuda"
    assert runner.kv_caches[0][0].device.type == "meta"
    assert runner.model.activation_dtype == torch.bfloat16
    kinds = _steps(runner)
    assert {"prefill"} in kinds and {"decode"} in kinds and {"prefill", "decode"} in kinds


@pytest.mark.parametrize(
    "name", ["slot_mapping", "decode_lens", "prefill_start", "temperature", "grammar_mask"]
)
def test_a_host_tensor_slipped_into_the_step_is_caught(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The mutation the proof must catch: one input left on the host (a KV write's slots,
    decode or prefill attention's lengths, the sampler's temperatures, a grammar's mask)."""
    upload = Staging.upload

    def leaky(self: Staging, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        tensors = upload(self, arrays)
        if name in arrays:
            tensors[name] = torch.from_numpy(arrays[name])
        return tensors

    monkeypatch.setattr(Staging, "upload", leaky)
    with pytest.raises(RuntimeError, match=r"tensors on \['cpu', 'meta'\]|device cpu"):
        _steps(runner)


def test_a_host_sync_in_the_step_is_caught(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other mutation: asking the device for a value mid-step (here, as an old sampler
    did, a torch generator per row seeded from `.tolist()`)."""

    def generators(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(probs)
        for row, seed in enumerate(seeds.tolist()):
            noise[row].exponential_(generator=torch.Generator().manual_seed(seed))
        return (probs / noise).argmax(dim=-1)

    monkeypatch.setattr(runner.backend, "race", generators)
    with pytest.raises(RuntimeError, match="no data"):
        _steps(runner)
