"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa: all-MiniLM, bge, e5, bge-m3, the bge and
ms-marco rerankers; ModernBERT: gte-modernbert, modernbert-embed, gte-reranker-modernbert) as
the executor computes them (`executor_svc/model/encoder.py`, `modernbert.py`): their
config.json read into `ModelInfo` fields, and the refusal, at start and by name, of what the
encoder does not compute."""

from __future__ import annotations

from typing import Any

from turnstile.shared.model_support import UnsupportedModel, refuse

# config.json's model_type
ENCODER_FAMILIES = ("bert", "roberta", "xlm-roberta", "modernbert")
# `architectures`: a bare encoder (an embedding model) or a sequence classifier (a reranker).
ENCODER_HEADS = ("Model", "ForSequenceClassification")
# hidden_act, as transformers names them: GELU's erf form, its tanh forms, ReLU.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
ENCODER_POOLING = ("cls", "mean", "last")  # what the encoder computes of its final states


def is_encoder(config: dict[str, Any]) -> bool:
    return config.get("model_type") in ENCODER_FAMILIES


def encoder_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """`ModelInfo`'s shape fields of an encoder's config.json. RoBERTa's positions start past
    its padding index (`pad_token_id` + 1), so its context is that much shorter than its table."""
    _check(config, source)
    if config["model_type"] == "modernbert":
        return _modernbert_fields(config, source)
    heads = config["num_attention_heads"]
    offset = 0 if config["model_type"] == "bert" else int(config.get("pad_token_id", 1)) + 1
    return {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": config["hidden_size"] // heads,
        "vocab_size": config["vocab_size"],
        "max_model_len": config.get("max_position_embeddings", 512) - offset,
        "rope_theta": 0.0,
        "rms_norm_eps": 0.0,
        "bos_token_id": config.get("bos_token_id"),
        # Nothing is generated; the sampled token every pooled request drops ends nothing.
        "eos_token_id": int(config.get("eos_token_id") or config.get("sep_token_id") or 0),
        "tie_word_embeddings": False,
        "attention_bias": True,
        "chat_template": None,
        "hidden_act": config.get("hidden_act", "gelu"),
        "encoder_only": True,
        "encoder_family": config["model_type"],
        "position_offset": offset,
        "token_types": int(config.get("type_vocab_size", 2)),
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12)),
        "pooling": "cls",  # vLLM's for these families where sentence-transformers says none
    }


def _modernbert_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """ModernBERT's: pre-norm layers without biases, RoPE (the global layers' base and the local
    ones'), every `global_attn_every_n_layers`-th layer global and the others attending
    `local_attention` tokens around each (half on either side), a GeGLU MLP; a classifier pools
    as `classifier_pooling` says, through a dense, activated and normed head."""
    layers, count = config["num_hidden_layers"], config["num_attention_heads"]
    every = int(config.get("global_attn_every_n_layers", 3))
    kinds = config.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(layers)
    ]
    window = int(config.get("local_attention", 128))
    rope = config.get("rope_parameters") or {}
    thetas = {kind: (rope.get(f"{kind}_attention") or {}).get("rope_theta")
              for kind in ("full", "sliding")}  # fmt: skip
    for kind, params in rope.items():
        if (params or {}).get("rope_type", "default") != "default":
            refuse(source, f"rope_parameters.{kind}.rope_type", params["rope_type"], "default only")
    act = config.get("hidden_activation", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        refuse(source, "hidden_activation", act, f"supported: {', '.join(ENCODER_ACTIVATIONS)}")
    if config.get("classifier_activation", "gelu") != "gelu":  # vLLM's head: GELU whatever it says
        refuse(source, "classifier_activation", config["classifier_activation"], "gelu only")
    pooling = config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        refuse(source, "classifier_pooling", pooling, "supported: cls, mean")
    heads = config.get("architectures") or ()
    classifier = any(name.endswith("ForSequenceClassification") for name in heads)
    return {
        "num_layers": layers,
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_heads": count,
        "num_kv_heads": count,
        "head_dim": config["hidden_size"] // count,
        "vocab_size": config["vocab_size"],
        "max_model_len": config.get("max_position_embeddings", 8192),
        "rope_theta": float(thetas["full"] or config.get("global_rope_theta", 160_000.0)),
        "local_rope_theta": float(thetas["sliding"] or config.get("local_rope_theta", 10_000.0)),
        "layer_windows": tuple(window if kind == "sliding_attention" else 0 for kind in kinds),
        "rms_norm_eps": 0.0,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": int(config.get("sep_token_id") or config.get("eos_token_id") or 0),
        "tie_word_embeddings": False,
        "attention_bias": bool(config.get("attention_bias", False)),
        "chat_template": None,
        "hidden_act": act,
        "encoder_only": True,
        "encoder_family": "modernbert",
        "layer_norm_eps": float(config.get("norm_eps", 1e-5)),
        # a classifier's own; an embedder's CLS, as vLLM's, where sentence-transformers is silent
        "pooling": pooling if classifier else "cls",
    }


def check_encoder_pooling(fields: dict[str, Any], source: str) -> None:
    """An embedding model pooled otherwise (sentence-transformers' max, a Dense module) is
    refused: it would answer nothing else. A classifier pools its CLS state."""
    if not fields.get("labels") and fields["pooling"] not in ENCODER_POOLING:
        raise UnsupportedModel(
            f"{source}: sentence-transformers' pooling {fields['pooling']!r} "
            f"is not supported (supported: {', '.join(ENCODER_POOLING)})"
        )


def _check(config: dict[str, Any], source: str) -> None:
    for name in [a for a in config.get("architectures") or () if not a.endswith(ENCODER_HEADS)]:
        refuse(source, "architectures", name, f"supported: *{', *'.join(ENCODER_HEADS)}")
    act = config.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        refuse(source, "hidden_act", act, f"supported: {', '.join(ENCODER_ACTIVATIONS)}")
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        refuse(source, "position_embedding_type", kind, "absolute positions only")
    for flag in ("is_decoder", "add_cross_attention"):
        if config.get(flag):
            refuse(source, flag, True, "an encoder-only model attends its own sequence only")
