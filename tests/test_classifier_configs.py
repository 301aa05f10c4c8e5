"""How a classifier's config.json is read, as vLLM reads it (`shared/pooling.hf_classifier`):
labels, activations, a head made of LM-head rows; the heads refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnstile.bench import random_llama
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.model_support import UnsupportedModel
from turnstile.shared.pooling import hf_classifier


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama.classifier(tmp_path_factory.mktemp("reranker"))


def test_classifier_configs_read_as_vllm_reads_them(reranker: Path) -> None:
    """Labels and activation from config.json, as vLLM's `get_act_fn` reads them; a head of
    LM-head rows as its `classifier_from_token` and `method` make one."""
    head = {"architectures": ["Qwen3ForSequenceClassification"]}
    assert hf_classifier({"architectures": ["Qwen3ForCausalLM"]}, "c", reranker) == {}
    assert hf_classifier(head, "c", reranker) == {  # transformers' default: 2 labels
        "labels": ("LABEL_0", "LABEL_1"), "classifier_activation": "softmax",
        "pair_separately": True,
    }  # fmt: skip
    one = {**head, "id2label": {"0": "score"}}
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    for config, activation in [
        (one, "sigmoid"), ({**head, "problem_type": "regression"}, "none"),
        ({**head, "problem_type": "multi_label_classification"}, "sigmoid"),
        ({**one, "sentence_transformers": identity}, "none"),
    ]:  # fmt: skip
        assert hf_classifier(config, "c", reranker)["classifier_activation"] == activation
    assert not hf_classifier({**one, "use_sep_token": False}, "c", reranker)["pair_separately"]
    rows = {**head, "classifier_from_token": ["w7", "w9", "w8"], "method": "no_post_processing"}
    assert hf_classifier(rows, "c", reranker) == {
        "labels": ("LABEL_0", "LABEL_1", "LABEL_2"), "classifier_activation": "softmax",
        "pair_separately": False, "classifier_tokens": (7, 9, 8),
        "classifier_method": "no_post_processing",
    }  # fmt: skip
    for refused, named in [
        ({"sbert_ce_default_activation_function": "os.system"}, "sbert_ce_default"),
        ({"classifier_from_token": ["w1", "w2", "w3"], "is_original_qwen3_reranker": True},
         "from_2_way_softmax"),
        ({"classifier_from_token": ["w1", "yes"], "method": "from_2_way_softmax"}, "'yes'"),
        ({"classifier_from_token": ["w1"], "method": "mean"}, "'mean'"),
    ]:  # fmt: skip
        with pytest.raises(UnsupportedModel, match=named):
            hf_classifier({**one, **refused}, "c", reranker)


def test_heads_other_than_these_are_refused(tmp_path: Path) -> None:
    """A token classifier's config is refused at start, by name; so is --hf-overrides of a
    GGUF file."""
    model = random_llama.classifier(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["Qwen3ForTokenClassification"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="Qwen3ForTokenClassification"):
        read_model_info(model)
    with pytest.raises(UnsupportedModel, match="hf-overrides"):  # a GGUF file has no config
        read_model_info(embedded_model_path(), {"architectures": ["LlamaForCausalLM"]})
