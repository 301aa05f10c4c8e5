"""A tiny gpt-oss whose greedy answers are known before it runs, for the harmony reader's tests
through a real stack: its attention and experts write nothing (o and down weights zero), so each
next token depends on the last one only, and its embeddings and head are set so that each token
of the scripts below is followed by the next. Harmony's markers are special tokens, as in
gpt-oss's vocabulary; a marker a script needs twice is spelled the second time from plain
pieces (the decoder joins tokens as they are), which the reader cannot tell apart.

A chat without tools ends its prompt with `assistant` and answers `ANSWER`; with tools it ends
with `toolstart` and answers `CALL`. The template is this test's own, harmony-like; an earlier
answer's analysis it reads as `thinking`, as gpt-oss's does."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]  # fmt: skip
REASONING, CONTENT = "Let me add them.", "The sum is 4."
ARGUMENTS = '{"city": "Paris"}'
# Each a chain from the prompt's last word: every piece once, in the whole model.
ANSWER = ["assistant", "<|channel|>", "analysis", "<|message|>", "Let me ", "add them.", "<|end|>",
          "<|start|>", "assis", "tant", "<|chan", "nel|>", "final", "<|mess", "age|>",
          "The sum ", "is 4.", "<|return|>"]  # fmt: skip
CALL = ["toolstart", "<|cha", "nnel|>", "commentary to=functions.get_weather ", "<|constrain|>",
        "json", "<|mes", "sage|>", '{"city": ', '"Paris"}', "<|call|>"]  # fmt: skip
TEMPLATE = (
    "{% if reasoning_effort %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
    "{% endif %}{% for m in messages %}{% if m.thinking %}<|start|>assistant<|channel|>analysis"
    "<|message|>{{ m.thinking }}<|end|>{% endif %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>{% if tools %}assistant toolstart"
    "{% else %}assistant{% endif %}{% endif %}"
)


def write(folder: Path) -> Path:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1,
        eos_token_id=SPECIAL_IDS["<|return|>"],
    )  # fmt: skip
    transformers.GptOssForCausalLM(config).save_pretrained(folder)
    transformers.GenerationConfig(
        eos_token_id=[SPECIAL_IDS["<|return|>"], SPECIAL_IDS["<|call|>"]]
    ).save_pretrained(folder)
    ids = _ids()
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj", "down_proj_bias")):
            weights[name].zero_()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed.mul_(0.01)
    head.zero_()
    for chain in (ANSWER, CALL):
        for piece, following in itertools.pairwise(chain):
            row = ids[piece]
            embed[row] = 0.0
            embed[row, row % 128] = 1.0  # each chain's piece its own direction
            head[ids[following], row % 128] = 10.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    vocab = {piece: i for piece, i in ids.items() if piece not in SPECIAL_IDS}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for s, i in SPECIAL_IDS.items()],
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": {"type": "Fuse"}, "model": {"type": "WordLevel", "vocab": vocab,
                                               "unk_token": "w0"},
    }))  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
        "bos_token": "w1", "eos_token": "<|return|>", "model_max_length": 512,
    }))  # fmt: skip
    return folder


SPECIAL_IDS = {marker: 500 + i for i, marker in enumerate(SPECIAL)}


def _ids() -> dict[str, int]:
    """Every piece's id: the scripts' from 400 on (each under 128 apart, its own direction)."""
    pieces = [p for p in dict.fromkeys(ANSWER + CALL) if p not in SPECIAL_IDS]
    scripts = {piece: 400 + i for i, piece in enumerate(pieces)}
    # every id below the markers' a word: the tokenizer numbers added tokens after its vocabulary
    words = {f"w{i}": i for i in [*range(400), *range(400 + len(pieces), 500)]}
    return words | scripts | SPECIAL_IDS
