"""LoRA adapters' rows in the cpu backend's fused layers (`kernels/native/lora.c`), on the
embedded model: against the model's layer code (its adapters added in torch), and, on the
GGUF file's quantized weights, a row's bits alone and batched, with or without adapters beside
it. An adapter of gate and up alone takes lora.c's second path where SiLU is computed inside
gate-up's product (AMX-INT8 tiles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.bench import random_llama
from turnstile.executor_svc.backends.native_decode import NativeDecode
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import Completion, OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.lora import LoraConfig, adapters
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import AddRequest, LoraRef, SamplingParams, pack_ids
from turnstile.shared.settings import build

pytestmark = pytest.mark.slow  # loads the embedded model a few times

PROMPTS = [[504, 3575, 282, 4649, 314], list(range(1000, 1040)), [1, 2, 3]]
MLP = ("gate_proj", "up_proj")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    info = read_model_info(embedded_model_path())
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        "every": random_llama.lora(tmp_path_factory.mktemp("every"), info, 8, every),
        "mlp": random_llama.lora(tmp_path_factory.mktemp("mlp"), info, 8, MLP),
    }


def engine(
    folders: dict[str, Path], fused: bool, mp: pytest.MonkeyPatch, **settings: str
) -> OfflineEngine:
    modules = [f"{name}={folder}" for name, folder in folders.items()]
    with mp.context() as patch:
        if not fused:
            patch.setattr(NativeDecode, "supports", staticmethod(lambda *_: False))
        built = OfflineEngine(
            build(RunnerConfig, num_blocks=64, max_num_seqs=8, enable_lora=True,
                  lora_modules=modules, **settings),
            SchedulingConfig(max_num_batched_tokens=16),  # chunks the 40-token prompt
        )  # fmt: skip
    assert built.runner.backend.name == "cpu"
    return built


def run(built: OfflineEngine, asks: list[tuple[LoraRef | None, int]]) -> list[Completion]:
    requests = [
        AddRequest(req_id=i, prompt_ids=pack_ids(PROMPTS[p]), max_tokens=10, ignore_eos=True,
                   sampling=SamplingParams(logprobs=4), lora=ref)
        for i, (ref, p) in enumerate(asks)
    ]  # fmt: skip
    return built.generate(requests)


def refs(built: OfflineEngine) -> dict[str, LoraRef]:
    config = LoraConfig(enable_lora=True, lora_modules=built.runner.config.lora.lora_modules)
    return {adapter.name: adapter.ref for adapter in adapters(config, built.runner.info)}


def test_fused_adapters_generate_what_the_layers_generate(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 weights: both routes compute the same sums in another order."""
    answers = {}
    for fused in (True, False):
        built = engine(folders, fused, monkeypatch, dtype="float32")
        named = refs(built)
        asks = [(named["every"], 0), (None, 1), (named["mlp"], 1), (named["every"], 2)]
        answers[fused] = run(built, asks)
    for fused, unfused in zip(answers[True], answers[False], strict=True):
        assert fused.token_ids == unfused.token_ids and len(fused.token_ids) == 10
        for ours, theirs in zip(fused.logprobs, unfused.logprobs, strict=True):
            assert [t for t, _ in ours] == [t for t, _ in theirs]
            assert max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs, strict=True)) < 1e-3
    base, adapted = (dict(answers[True][i].logprobs[0]) for i in (1, 2))  # the same prompt
    assert max(abs(base[t] - adapted[t]) for t in base.keys() & adapted.keys()) > 0.2


def test_quantized_rows_keep_their_bits_beside_adapters(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF file's weights (int8 products): every row takes the fused layers, so a base
    row's logprobs are the same bits beside adapters' rows as alone, and an adapter's row's the
    same batched as alone; the gate-and-up adapter's answer is nearer the model's layers'
    (int8's rounding apart: `INT8_ROUNDING`) than half the way to the base model's."""
    built = engine(folders, True, monkeypatch)
    named = refs(built)
    asks = [(None, 0), (named["mlp"], 1), (named["every"], 2), (None, 1), (named["mlp"], 0)]
    batched = run(built, asks)
    alone = [run(built, [ask])[0] for ask in asks]
    for one, many in zip(alone, batched, strict=True):
        assert one.logprobs == many.logprobs and one.token_ids == many.token_ids
    layers = engine(folders, False, monkeypatch)
    [reference] = run(layers, [(named["mlp"], 1)])
    first, theirs = dict(batched[1].logprobs[0]), dict(reference.logprobs[0])
    base = dict(batched[3].logprobs[0])
    assert batched[1].token_ids[0] == reference.token_ids[0]

    def apart(a: dict[int, float], b: dict[int, float]) -> float:
        return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())

    assert apart(first, base) > 0.2
    assert apart(first, theirs) < apart(first, base) / 2
