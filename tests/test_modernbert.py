"""ModernBERT (`executor_svc/model/modernbert.py`) on tiny random ones (`bench/random_encoder.py`:
4 layers, the middle two local, attending 8 tokens on either side) held to transformers: each
token's final state and the CLS vector of an embedder, a classifier's mean-pooled logits, in
steps of sequences padded together and one at a time, longer than the local window; the config
written either way transformers has written it; what it cannot compute refused by name. Through
a stack: `test_encoders.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from encoder_steps import step

from turnstile.bench import random_encoder
from turnstile.executor_svc.model.modernbert import ModernBertModel
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.shared.model_info import read_model_info
from turnstile.shared.model_support import UnsupportedModel

HEADS = {"Model": {}, "ForSequenceClassification": {"num_labels": 2, "classifier_pooling": "mean"}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = tmp_path_factory.mktemp("modernbert")
    return {head: random_encoder.encoder(made / head, "ModernBert", head, **config)
            for head, config in HEADS.items()}  # fmt: skip


# Padded together (past the 8 tokens a local layer sees on either side), and one at a time.
@pytest.mark.parametrize("lengths", [(20, 9, 18), (40, 1, 2)])
@pytest.mark.parametrize("head", list(HEADS))
def test_a_step_of_sequences_computes_as_transformers(
    folders: dict[str, Path], head: str, lengths: tuple[int, ...]
) -> None:
    import transformers
    from safetensors.torch import load_file

    folder = folders[head]
    info = read_model_info(folder)
    assert (info.encoder_family, info.layer_windows) == ("modernbert", (0, 16, 16, 0))
    assert (info.rope_theta, info.local_rope_theta, info.token_types) == (160_000, 10_000, 0)
    cpu = torch.device("cpu")
    weights = load_file(folder / "model.safetensors")
    model = ModernBertModel(info, weights, torch.float32, torch.float32, cpu, DenseProjection)
    ids, positions, batch = step(lengths)
    with torch.inference_mode():
        states = model.forward(ids, positions, batch)
        vectors = model.pooled(states[batch.starts[1:] - 1])
    reference = getattr(transformers, f"ModernBert{head}").from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for row, sequence in enumerate(ids.split(lengths)):
            answer = reference.eval()(sequence[None])
            if head == "Model":  # every state but the last (where the pooled one is) and CLS
                start, end = batch.bounds[row], batch.bounds[row + 1]
                expected = answer.last_hidden_state[0]
                torch.testing.assert_close(
                    states[start : end - 1], expected[:-1], atol=3e-5, rtol=0
                )
                torch.testing.assert_close(vectors[row], expected[0], atol=3e-5, rtol=0)
            else:
                torch.testing.assert_close(vectors[row], answer.logits[0], atol=3e-5, rtol=0)


def test_the_older_config_reads_the_same(folders: dict[str, Path], tmp_path: Path) -> None:
    """As ModernBERT's checkpoints on the Hub write it: every n-th layer global, both bases
    named, no layer_types."""
    config = json.loads((folders["Model"] / "config.json").read_text())
    for name in ("layer_types", "rope_parameters"):
        config.pop(name)
    config |= {"global_attn_every_n_layers": 2, "global_rope_theta": 8e4, "local_rope_theta": 5e3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = read_model_info(tmp_path)
    assert info.layer_windows == (0, 16, 0, 16)
    assert (info.rope_theta, info.local_rope_theta, info.pooling) == (8e4, 5e3, "cls")


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"architectures": ["ModernBertForMaskedLM"]}, "architectures"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"classifier_activation": "silu"}, "classifier_activation"),
        ({"classifier_pooling": "max"}, "classifier_pooling"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
         "rope_type"),
    ],
)  # fmt: skip
def test_what_it_cannot_compute_is_refused_by_name(
    folders: dict[str, Path], tmp_path: Path, changed: dict, named: str
) -> None:
    config = json.loads((folders["Model"] / "config.json").read_text()) | changed
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=named):
        read_model_info(tmp_path)
