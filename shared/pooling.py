"""How a model makes one embedding of a text from its hidden states, read as vLLM and llama.cpp
read it: a sentence-transformers folder's `modules.json` (its Pooling module's mode, a
Normalize module), a GGUF file's `{arch}.pooling_type`. A model that says nothing pools its
last token and normalizes it, as vLLM does for a decoder served as an embedding model.
`ModelInfo` keeps the result; the gateway refuses embeddings of any other pooling."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# sentence-transformers' Pooling config keys, by the name a refusal gives them.
_MODES = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}  # fmt: skip
_GGUF_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum
_PLAIN = ("Transformer", "Pooling", "Normalize")  # modules whose work is computed here


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
