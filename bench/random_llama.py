"""Writes a random-weight Llama that two ranks can split (8 query heads, 4 KV heads, ~110M
parameters) and a word-level tokenizer, for tensor-parallel figures:
    .venv/bin/python -m turnstile.bench.random_llama DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FOR_TWO_RANKS = dict(
    vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # fmt: skip


def write(folder: Path, family: str = "Llama", **shape: object) -> Path:
    """A random model of `family` (as transformers names its classes: Llama, Mixtral...) and
    `shape` (its config's fields; FOR_TWO_RANKS by default) in `folder`, with a tokenizer whose
    words are w0, w1, ..."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**(shape or FOR_TWO_RANKS))
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    words = {f"w{i}": i for i in range(config.vocab_size)}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"},
    }))  # fmt: skip
    return folder


if __name__ == "__main__":
    write(Path(sys.argv[1]))
