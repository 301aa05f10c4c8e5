"""Tiny random encoders (BERT, XLM-RoBERTa: 2 layers, hidden size 128, a vocabulary of 512;
ModernBERT: 4 layers, the first and last global, the others attending 8 tokens on either side),
with a word tokenizer that wraps texts as theirs do: BERT's and ModernBERT's [CLS] A [SEP] B
[SEP] (w1, w2; BERT's B and its [SEP] typed 1), XLM-R's <s> A </s></s> B </s> (w0, w2; all
typed 0); optionally sentence-transformers' modules (a pooling mode, normalized)."""

from __future__ import annotations

import json
from pathlib import Path

from turnstile.bench.random_llama import EMBEDDER_MODULES, write

TINY_BERT = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
    position_embedding_type="absolute",  # as real checkpoints write it (vLLM reads it)
)  # fmt: skip
# XLM-R's positions start past its padding index (1): its table is two rows longer.
TINY_XLM_ROBERTA = TINY_BERT | dict(
    max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
    eos_token_id=2,
)  # fmt: skip

TINY_MODERNBERT = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
    local_attention=16, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
    cls_token_id=1, eos_token_id=2, sep_token_id=2,
)  # fmt: skip
SHAPES = {"Bert": TINY_BERT, "XLMRoberta": TINY_XLM_ROBERTA, "ModernBert": TINY_MODERNBERT}

# sentence-transformers' Pooling config keys
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                "last": "pooling_mode_lasttoken", "max": "pooling_mode_max_tokens"}  # fmt: skip


def encoder(
    folder: Path, family: str = "Bert", head: str = "Model", pooling: str | None = None,
    **config: object,
) -> Path:  # fmt: skip
    """A tiny random `family` (a key of SHAPES; `config`'s fields replace its shape's) with
    `head` ("Model", "ForSequenceClassification"); with `pooling` (a key of POOLING_KEYS),
    sentence-transformers' modules: that pooling, then Normalize."""
    bert = family != "XLMRoberta"  # BERT's wrapping
    write(folder, family, head, **SHAPES[family] | config)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    first, end = ("w1" if bert else "w0"), "w2"

    def part(kind: str, name: str, type_id: int) -> dict:
        return {kind: {"id": name, "type_id": type_id}}

    two = int(family == "Bert")  # BERT's second text is typed 1
    a, b = part("Sequence", "A", 0), part("Sequence", "B", two)
    starts, ends = part("SpecialToken", first, 0), part("SpecialToken", end, 0)
    pair = [starts, a, ends, b, part("SpecialToken", end, two)]
    if not bert:
        pair = [starts, a, ends, ends, b, ends]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [starts, a, ends], "pair": pair,
        "special_tokens": {w: {"id": w, "ids": [int(w[1:])], "tokens": [w]} for w in (first, end)},
    }  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if two else ["input_ids"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "model_input_names": inputs,  # BERT's tokenizer gives each token's type
    }))  # fmt: skip
    if pooling is not None:
        (folder / "modules.json").write_text(json.dumps(EMBEDDER_MODULES))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        mode = {"word_embedding_dimension": 128, POOLING_KEYS[pooling]: True}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    return folder
