"""How a model makes one embedding of a text from its hidden states, read as vLLM and llama.cpp
read it: a sentence-transformers folder's `modules.json` (its Pooling module's mode, a
Normalize module), a GGUF file's `{arch}.pooling_type`. A model that says nothing pools its
last token and normalizes it, as vLLM does for a decoder served as an embedding model.
`ModelInfo` keeps the result; the gateway refuses embeddings of any other pooling. A sequence
classifier (`*ForSequenceClassification`) scores its last token's hidden state with its `score`
head instead, each row a label, activated as vLLM activates it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnstile.shared.model_support import UnsupportedModel

# sentence-transformers' Pooling config keys, by the name a refusal gives them.
_MODES = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}  # fmt: skip
_GGUF_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum
_PLAIN = ("Transformer", "Pooling", "Normalize")  # modules whose work is computed here
# A cross-encoder's activation, as sentence-transformers names it: vLLM's default (a sigmoid of
# one label, a softmax of several) for these two, none for Identity.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "", "torch.nn.modules.activation.Softmax": "",
    "torch.nn.modules.linear.Identity": "none",
}  # fmt: skip


def hf_pooling(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`ModelInfo`'s pooling fields for a Hugging Face folder and its config.json."""
    dimensions = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    fields: dict[str, Any] = {
        "is_matryoshka": bool(config.get("is_matryoshka")) or bool(dimensions),
        "matryoshka_dimensions": dimensions,
    }
    listed = folder / "modules.json"
    if not listed.exists():
        return fields
    modules = json.loads(listed.read_text())
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    mode = "none"
    for module, kind in zip(modules, kinds, strict=True):
        if kind == "Pooling":
            pooling = json.loads((folder / module["path"] / "config.json").read_text())
            mode = "+".join(name for key, name in _MODES.items() if pooling.get(key)) or "none"
    extra = [kind for kind in kinds if kind not in _PLAIN]
    fields["pooling"] = " then ".join([mode, *extra])
    fields["normalize_embeddings"] = "Normalize" in kinds
    return fields


def gguf_pooling(arch: str, field: Callable[..., Any]) -> dict[str, Any]:
    """`ModelInfo`'s pooling fields for a GGUF file (`field(key, default)`: its metadata)."""
    kind = field(f"{arch}.pooling_type")
    return {} if kind is None else {"pooling": _GGUF_TYPES.get(int(kind), f"type {kind}")}


def hf_classifier(config: dict[str, Any], source: str) -> dict[str, Any]:
    """`ModelInfo`'s classifier fields for a config.json; {} for a language model. Labels as
    transformers numbers them (`id2label`, else `num_labels` of LABEL_i, 2 by default)."""
    if not any(
        str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()
    ):
        return {}
    for key in ("classifier_from_token", "method"):  # vLLM's head made of the LM head's rows
        if key in config:
            raise UnsupportedModel(
                f"{source}: {key} = {config[key]!r} is not supported (a classifier's head made "
                "of its language model's token rows)"
            )
    named = config.get("id2label") or {}
    count = len(named) or int(config.get("num_labels", 2))
    labels = tuple(str(named.get(str(i), f"LABEL_{i}")) for i in range(count))
    return {"labels": labels, "classifier_activation": _activation(config, count, source),
            "pair_separately": bool(config.get("use_sep_token", True))}  # fmt: skip


def _activation(config: dict[str, Any], count: int, source: str) -> str:
    """vLLM's (after transformers' losses): "sigmoid", "softmax" or "none"."""
    default = "sigmoid" if count < 2 else "softmax"
    kind = config.get("problem_type") or ""
    if kind in ("regression", "multi_label_classification", "single_label_classification"):
        return {"regression": "none", "multi_label_classification": "sigmoid"}.get(kind, default)
    listed = config.get("sentence_transformers") or {}
    key = "sentence_transformers.activation_fn"
    if "activation_fn" not in listed:
        key, listed = "sbert_ce_default_activation_function", config
    named = listed.get(key.rsplit(".", 1)[-1])
    if named is None:
        return default
    if named not in _ACTIVATIONS:
        raise UnsupportedModel(f"{source}: {key} = {named!r} is not supported "
                               f"(supported: {', '.join(_ACTIVATIONS)})")  # fmt: skip
    return _ACTIVATIONS[named] or default
