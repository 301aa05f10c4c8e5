"""An encoder's pieces without a stack: the model's batched step against transformers, its
config read and refused by name, and the scheduler giving each prompt whole."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from encoder_steps import step
from scheduler_harness import Harness

from turnstile.bench import random_encoder
from turnstile.executor_svc.model.encoder import EncoderModel
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.scheduler_svc.request import Request
from turnstile.scheduler_svc.token_budget import split_budget
from turnstile.shared.config import EngineConfig, SchedulerConfig, SchedulingConfig
from turnstile.shared.lora import LoraConfig, adapters
from turnstile.shared.model_info import read_model_info
from turnstile.shared.model_support import UnsupportedModel
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids, unpack_ids
from turnstile.shared.settings import build
from turnstile.shared.sharding import ShardingError, check_sharding

LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    labels = dict(enumerate(LABELS))
    folder = tmp_path_factory.mktemp("xlmr")
    head = "ForSequenceClassification"
    return random_encoder.encoder(folder, "XLMRoberta", head, id2label=labels)


# Sequences of one step: padded to the longest (one of one token), or one at a time (one long).
@pytest.mark.parametrize("lengths", [(5, 1, 9), (40, 1, 2)])
def test_sequences_of_one_step_each_attend_only_themselves(
    xlm_roberta: Path, lengths: tuple[int, ...]
) -> None:
    """An XLM-R classifier (positions past its padding index, RoBERTa's head on each CLS state)
    on sequences of different lengths in one step, against transformers' logits."""
    import transformers
    from safetensors.torch import load_file

    info = read_model_info(xlm_roberta)
    assert (info.encoder_only, info.labels, info.classifier_activation) == (
        True, LABELS, "softmax",
    )  # fmt: skip
    assert (info.position_offset, info.max_model_len, info.token_types) == (2, 512, 1)
    weights = load_file(xlm_roberta / "model.safetensors")
    cpu = torch.device("cpu")
    model = EncoderModel(info, weights, torch.float32, torch.float32, cpu, DenseProjection)
    ids, positions, batch = step(lengths)
    with torch.inference_mode():
        logits = model.pooled(model.forward(ids, positions, batch)[batch.starts[1:] - 1])
        # One token type: a pair typed 1 (a hostile peer's) reads type 0, as it must.
        typed = replace(batch, token_types=torch.ones_like(ids))
        torch.testing.assert_close(
            model.forward(ids, positions, typed), model.forward(ids, positions, batch)
        )
    auto = transformers.AutoModelForSequenceClassification
    reference = auto.from_pretrained(xlm_roberta, dtype=torch.float32).eval()
    with torch.no_grad():
        for row, sequence in enumerate(ids.split(lengths)):
            expected = reference(sequence[None]).logits[0]
            torch.testing.assert_close(logits[row], expected, atol=2e-5, rtol=0)


def write_config(folder: Path, **changed: object) -> Path:
    config = json.loads((folder / "config.json").read_text()) | changed
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"architectures": ["BertForMaskedLM"]}, "architectures"),
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"is_decoder": True}, "is_decoder"),
    ],
)
def test_an_encoder_asking_for_what_is_not_computed_is_refused_by_name(
    tmp_path: Path, changed: dict, named: str
) -> None:
    folder = write_config(random_encoder.encoder(tmp_path), **changed)
    with pytest.raises(UnsupportedModel, match=named):
        read_model_info(folder)


def test_an_embedder_pooled_by_max_is_refused_and_settings_it_cannot_take_are_too(
    tmp_path: Path,
) -> None:
    with pytest.raises(UnsupportedModel, match="pooling 'max'"):
        read_model_info(random_encoder.encoder(tmp_path / "max", pooling="max"))
    bare = read_model_info(random_encoder.encoder(tmp_path / "bare", "XLMRoberta"))
    assert (bare.pooling, bare.labels) == ("cls", ())  # vLLM's where nothing says otherwise
    info = read_model_info(random_encoder.encoder(tmp_path / "mean", pooling="mean"))
    assert (info.pooling, info.normalize_embeddings, info.token_types) == ("mean", True, 2)
    with pytest.raises(ShardingError, match="encoder"):
        check_sharding(info, 2)
    with pytest.raises(ValueError, match="encoder"):
        adapters(LoraConfig(enable_lora=True), info)
    with pytest.raises(ValueError, match=r"runner generate: .* is an encoder"):
        EngineConfig(model=str(tmp_path / "mean"), runner="generate").model_info()


def test_an_encoders_prompts_are_scheduled_whole_or_not_at_all() -> None:
    want = np.array([1, 50, 40, 30])  # a decode, then three prompts
    np.testing.assert_array_equal(split_budget(want, 100), [1, 50, 40, 9])
    np.testing.assert_array_equal(split_budget(want, 100, whole=True), [1, 50, 40, 0])
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=4096,
                             whole_prompts=True)  # fmt: skip
    assert config.token_budget == 4096  # not given: raised to the longest prompt, as vLLM
    with pytest.raises(ValueError, match="max-num-batched-tokens 256 is less than the context"):
        SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=512,
                        scheduling=SchedulingConfig(max_num_batched_tokens=256),
                        whole_prompts=True)  # fmt: skip
    assert not config.prefix_caching  # each prompt computed from its first token


@pytest.mark.parametrize("ahead", [0, 1])  # lockstep, async scheduling
def test_an_encoders_prompts_are_admitted_whole_and_never_from_the_cache(ahead: int) -> None:
    config = build(SchedulerConfig, num_blocks=64, block_size=4, max_num_seqs=8,
                   max_num_batched_tokens=16, max_model_len=16, whole_prompts=True)  # fmt: skip
    harness = Harness(config, {1: 1, 2: 1, 3: 1}, ahead=ahead)
    shared = list(range(10, 18))  # two blocks, cached once the first request ends
    harness.add(1, [*shared, 30, 31], max_tokens=1)
    harness.add(2, [40, 41, 42], max_tokens=1)
    harness.add(3, [*shared, 50], max_tokens=1)  # 9 tokens: 3 left in the first step
    first = harness.step()
    assert [(new.num_computed, new.num_scheduled) for new in first.new] == [(0, 10), (0, 3)]
    harness.run()
    later = [new for plan in harness.plans[1:] for new in plan.new]
    assert [(new.num_computed, new.num_scheduled) for new in later] == [(0, 9)]
    # Nothing more computed: a request that sampled its one token is only removed (async
    # scheduling's step planned before that token came back computes none of it).
    assert len(harness.plans) == 2 + ahead
    assert not any(unpack_ids(plan.override_counts).any() for plan in harness.plans)


def test_serve_refuses_steps_shorter_than_an_encoders_context(tmp_path: Path) -> None:
    folder = str(random_encoder.encoder(tmp_path))
    command = [sys.executable, "-m", "turnstile.cli", "serve", "--model", folder, "--max-model-len",
               "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--max-num-batched-tokens 64 is less than the context (128)" in done.stderr


def test_a_pair_position_no_pooled_pair_can_have_is_refused_by_the_scheduler() -> None:
    for sampling in (SamplingParams(embed=True, second_text=-5), SamplingParams(second_text=2)):
        request = AddRequest(req_id=1, prompt_ids=pack_ids([5, 6, 7]), max_tokens=1,
                             sampling=sampling)  # fmt: skip
        with pytest.raises(ValueError, match="second_text"):
            Request.from_message(request, 0, 64, 512)


@pytest.mark.parametrize("whole", [False, True])  # a decoder's pooled prompt, an encoder's
@pytest.mark.parametrize("ahead", [0, 1])
def test_a_pooled_prompt_may_fill_the_context_and_a_generated_one_may_not(
    ahead: int, whole: bool
) -> None:
    """As vLLM: a pooled prompt of the whole context runs (its one token sampled past it and
    dropped); a prompt to generate from leaves room for a token; neither goes past it."""
    config = build(SchedulerConfig, num_blocks=64, block_size=4, max_num_seqs=4,
                   max_num_batched_tokens=16, max_model_len=16, whole_prompts=whole)  # fmt: skip
    harness = Harness(config, {1: 1, 2: 1}, ahead=ahead)
    harness.add(1, list(range(10, 26)), max_tokens=1, ignore_eos=True, embed=True)
    for req_id, length, embed in ((3, 16, False), (4, 17, True)):
        with pytest.raises(ValueError, match=f"must have between 1 and {15 + embed} "):
            harness.add(req_id, list(range(10, 10 + length)), max_tokens=1, embed=embed)
    harness.add(2, list(range(30, 45)), max_tokens=1, ignore_eos=True)
    assert [(new.req_id, new.num_scheduled) for new in harness.step().new] == [(1, 16)]
    harness.run()
    assert harness.endings == {1: ["length"], 2: ["length"]}
    assert len(harness.tokens[1]) == len(harness.tokens[2]) == 1
