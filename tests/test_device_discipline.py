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

from pathlib import Path

import numpy as np
import pytest
import torch
from plan_ahead import answers, scheduler_for

from turnstile.bench import random_encoder, random_llama
from turnstile.executor_svc import model_runner, step_in_flight
from turnstile.executor_svc.backend import DeviceStep
from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.plan_applier import StepInputs
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.staging import Staging
from turnstile.executor_svc.step_in_flight import Carry, PendingStep, StepInFlight
from turnstile.offline import run_steps
from turnstile.shared.lora import adapters
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import AddRequest, BatchPlan, Grammar, SamplingParams, pack_ids
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


class _MetaCopy:
    """The sampled tokens' copy to the host: meta has no values to copy, so token 42 (and
    its logprobs, 42 too) stands in for them."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def numpy(self) -> np.ndarray:
        return np.full(self.shape, 42.0)


@pytest.fixture(autouse=True)
def _meta_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_in_flight, "HostCopy", _MetaCopy)


@pytest.fixture(scope="module")
def lora_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """As `runner`, holding a LoRA adapter."""
    adapter = random_llama.lora(tmp_path_factory.mktemp("adapter"),
                                read_model_info(embedded_model_path()))  # fmt: skip
    config = build(
        RunnerConfig, dtype="bfloat16", device="meta", backend="cuda", num_blocks=64,
        max_num_seqs=8, enable_lora=True, lora_modules=[f"a={adapter}"],
    )  # fmt: skip
    return ModelRunner(config)


def _steps(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, params: list[SamplingParams] = PARAMS
) -> list[set[str]]:
    """Run the real scheduler's plans on meta until every request is done, each launched
    behind the one before (its inputs take that step's tokens on the device); the kinds of
    rows (prefill, decode) in each step. Checks that some tokens were taken so. With a runner
    that holds an adapter, every other request runs it."""
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140)), [7, 8], list(range(300, 317)), [9] * 20]
    named = adapters(runner.config.lora, runner.info)
    requests = [
        AddRequest(req_id=i, prompt_ids=pack_ids(prompt), max_tokens=4, ignore_eos=True,
                   sampling=params, lora=named[0].ref if named and i % 2 else None)
        for i, (prompt, params) in enumerate(zip(prompts, params, strict=True))
    ]  # fmt: skip
    scheduler = scheduler_for(
        runner, requests, max_num_seqs=8, max_num_batched_tokens=24,
        max_loras=runner.max_loras,
    )  # fmt: skip
    kinds, carried = [], []
    upload = runner.upload

    def seen(inputs: StepInputs, found: Carry | None = None) -> DeviceStep:
        kinds.append({"decode" if n == 1 else "prefill" for n in np.diff(inputs.query_start_loc)})
        carried.append(found is not None)
        return upload(inputs, found)

    def launch(plan: BatchPlan) -> PendingStep:
        launched = runner.launch(plan)
        if isinstance(launched, StepInFlight):
            sampled = launched.sampled
            assert sampled.tokens.device.type == "meta"
            assert sampled.tokens.shape == launched.rows.shape
            if sampled.asking:
                assert sampled.logprobs is not None
                width = 1 + 2 * max(n for _, n in sampled.asking)
                assert sampled.logprobs.shape == (len(sampled.asking), width)
        return launched

    monkeypatch.setattr(runner, "upload", seen)
    assert not any(answer.refused for answer in answers(scheduler, launch))
    monkeypatch.setattr(runner, "upload", upload)
    assert any(carried)
    return kinds


def test_a_whole_cuda_step_stays_on_the_device(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert runner.backend.name == "cuda"
    assert runner.kv_caches[0][0].device.type == "meta"
    assert runner.model.activation_dtype == torch.bfloat16
    kinds = _steps(runner, monkeypatch)
    assert {"prefill"} in kinds and {"decode"} in kinds and {"prefill", "decode"} in kinds


def test_a_step_with_lora_adapters_stays_on_the_device(
    lora_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinds = _steps(lora_runner, monkeypatch)
    assert {"prefill", "decode"} in kinds and {"decode"} in kinds


def test_a_gpt_oss_step_stays_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's sinks (through the Triton ops' fakes), biases and experts; a random model
    without a tokenizer, so no grammar's row."""
    from test_gpt_oss import _gpt_oss

    _gpt_oss(tmp_path)
    config = build(RunnerConfig, model=str(tmp_path), dtype="bfloat16", device="meta",
                   backend="cuda", num_blocks=64, max_num_seqs=8)  # fmt: skip
    kinds = _steps(ModelRunner(config), monkeypatch, [*PARAMS[:4], SamplingParams(seed=5)])
    assert {"prefill", "decode"} in kinds and {"decode"} in kinds


def test_a_step_verifying_drafts_stays_on_the_device(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding: rows verify drafted tokens (meta samples token 42 throughout, so
    drafts of it stand), beside a grammar's row, which never drafts; every drafted position
    samples on the device."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    requests = [
        AddRequest(req_id=i, prompt_ids=pack_ids([5 + i] * 9 + [42]), max_tokens=9,
                   ignore_eos=True, sampling=params)
        for i, params in enumerate(PARAMS)
    ]  # fmt: skip
    scheduler = scheduler_for(runner, requests, max_num_seqs=8, speculative_config=ngram)
    positions = []

    def launch(plan: BatchPlan) -> PendingStep:
        launched = runner.launch(plan)
        assert isinstance(launched, StepInFlight)
        assert launched.sampled.tokens.device.type == "meta"
        positions.append(launched.sampled.tokens.shape[0] - len(launched.rows))
        return launched

    answered = [answer for answer, _ in run_steps(scheduler, launch, ahead=1)]
    assert not any(answer.refused for answer in answered)
    assert scheduler.stats.spec_accepted_tokens > 0 and max(positions) > 0


@pytest.mark.parametrize("family", ["Bert", "ModernBert"])
def test_an_encoders_step_stays_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """A BERT cross-encoder's whole prompts in one step (two pairs, their second texts typed 1,
    and a text alone), or a ModernBERT one's (its rotations, local layers' windows narrower
    than the longest): padded attention, pooling, its head; no KV cache."""
    folder = random_encoder.encoder(tmp_path, family, "ForSequenceClassification", num_labels=1)
    config = build(RunnerConfig, model=str(folder), dtype="bfloat16", device="meta",
                   backend="cuda", max_num_seqs=8)  # fmt: skip
    runner = ModelRunner(config)
    assert runner.kv_caches == [] and runner.info.encoder_only

    def typed(second: int) -> int:  # ModernBERT types no token
        return second if family == "Bert" else -1

    requests = [
        AddRequest(req_id=i, prompt_ids=pack_ids(list(range(5, 5 + length))), max_tokens=1,
                   ignore_eos=True, sampling=SamplingParams(embed=True, second_text=typed(second)))
        for i, (length, second) in enumerate([(9, 4), (3, -1), (20, 12)])
    ]  # fmt: skip
    scheduler = scheduler_for(runner, requests, max_num_seqs=8, whole_prompts=True)
    vectors = []

    def embeddings(req_ids: np.ndarray, rows: np.ndarray, pooled: torch.Tensor) -> list:
        vectors.append(pooled)  # on meta: no values to send
        return []

    monkeypatch.setattr(model_runner, "embeddings", embeddings)
    assert not any(answer.refused for answer in answers(scheduler, runner.launch))
    assert [(v.device.type, tuple(v.shape)) for v in vectors] == [("meta", (3, 1))]


@pytest.mark.parametrize(
    "name",
    ["slot_mapping", "decode_lens", "prefill_start", "temperature", "grammar_mask", "lora_tokens"],
)
def test_a_host_tensor_slipped_into_the_step_is_caught(
    runner: ModelRunner, lora_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The mutation the proof must catch: one input left on the host (a KV write's slots,
    decode or prefill attention's lengths, the sampler's temperatures, a grammar's mask, the
    tokens that run an adapter)."""
    runner = lora_runner if name == "lora_tokens" else runner
    upload = Staging.upload

    def leaky(self: Staging, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        tensors = upload(self, arrays)
        if name in arrays:
            tensors[name] = torch.from_numpy(arrays[name])
        return tensors

    monkeypatch.setattr(Staging, "upload", leaky)
    with pytest.raises(RuntimeError, match=r"tensors on \['cpu', 'meta'\]|device cpu|same device"):
        _steps(runner, monkeypatch)


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
        _steps(runner, monkeypatch)
