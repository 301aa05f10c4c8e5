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
_TWO_WAY = "from_2_way_softmax"  # vLLM's methods of a head made of LM-head rows
_TOKEN_METHODS = (_TWO_WAY, "no_post_processing")
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


def hf_classifier(config: dict[str, Any], source: str, folder: Path) -> dict[str, Any]:
    """`ModelInfo`'s classifier fields for a config.json; {} for a language model. Labels as
    transformers numbers them (`id2label`, else `num_labels` of LABEL_i, 2 by default). A head
    of LM-head rows (vLLM's `classifier_from_token` and `method`; Qwen3-Reranker's
    `is_original_qwen3_reranker`) has its tokens' ids read from the folder's tokenizer."""
    if not any(
        str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()
    ):
        return {}
    tokens = config.get("classifier_from_token")
    method = config.get("method") or (
        "from_2_way_softmax" if config.get("is_original_qwen3_reranker") else None
    )
    if tokens is None and method is None:
        named = config.get("id2label") or {}
        count = len(named) or int(config.get("num_labels", 2))
        labels = tuple(str(named.get(str(i), f"LABEL_{i}")) for i in range(count))
        return {"labels": labels, "classifier_activation": _activation(config, count, source),
                "pair_separately": bool(config.get("use_sep_token", True))}  # fmt: skip
    if method not in _TOKEN_METHODS or not tokens or (method == _TWO_WAY and len(tokens) != 2):
        raise UnsupportedModel(
            f"{source}: method = {method!r} with classifier_from_token = {tokens!r} is not "
            f"supported (supported: {_TWO_WAY} of two tokens, no_post_processing of any)"
        )
    count = 1 if method == _TWO_WAY else len(tokens)
    ids = _token_ids(folder, tokens, source)
    return {"labels": tuple(f"LABEL_{i}" for i in range(count)),
            "classifier_activation": _activation(config, count, source),
            "pair_separately": bool(config.get("use_sep_token", False)),  # an LLM reranker's
            "classifier_tokens": ids, "classifier_method": method}  # fmt: skip


def _token_ids(folder: Path, tokens: list[str], source: str) -> tuple[int, ...]:
    import tokenizers

    vocabulary = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [vocabulary.token_to_id(token) for token in tokens]
    if None in ids:
        missing = tokens[ids.index(None)]
        raise UnsupportedModel(f"{source}: classifier_from_token = {tokens!r}: {missing!r} is "
                               "no token of the tokenizer")  # fmt: skip
    return tuple(ids)  # type: ignore[arg-type]


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
