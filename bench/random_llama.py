"""Writes a random-weight Llama that two ranks can split (8 query heads, 4 KV heads, ~110M
parameters) and a word-level tokenizer, for tensor-parallel figures:
    .venv/bin/python -m turnstile.bench.random_llama DIR
a tiny one with <think> and </think> tokens for reasoning parsers (`thinker`), and a tiny Qwen3
laid out as Qwen3-Embedding is (`embedder`), a tiny Qwen3 sequence classifier (`classifier`); a
random LoRA adapter for any model (`lora`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from turnstile.shared.lora import ATTENTION, module_shapes
from turnstile.shared.model_info import ModelInfo

FOR_TWO_RANKS = dict(
    vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # fmt: skip


def write(folder: Path, family: str = "Llama", head: str = "ForCausalLM", **shape: object) -> Path:
    """A random model of `family` (as transformers names its classes: Llama, Mixtral...) with
    `head` and `shape` (its config's fields; FOR_TWO_RANKS by default) in `folder`, with a
    tokenizer whose words are w0, w1, ..."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**(shape or FOR_TWO_RANKS))
    getattr(transformers, f"{family}{head}")(config).save_pretrained(folder)
    words = {f"w{i}": i for i in range(config.vocab_size)}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"},
    }))  # fmt: skip
    return folder


# A tiny Qwen3 (2 layers, hidden size 128, a vocabulary of 512): embedders and classifiers.
TINY_QWEN3 = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    initializer_range=0.2,
)  # fmt: skip

THINK_TOKENS = (510, 511)  # a thinker's <think> and </think>, in place of w510 and w511
# A template that opens the thinking in the prompt, as DeepSeek-R1's, and closes it there with
# enable_thinking false, as Qwen3's; an assistant's earlier thinking is written out.
THINKER_TEMPLATE = (
    "{% for m in messages %}{% if m.reasoning_content %}<think> {{ m.reasoning_content }} "
    "</think> {% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w3 "
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% else %}"
    "<think> {% endif %}{% endif %}"
)


def thinker(folder: Path) -> Path:
    """A tiny random Llama (2 layers, vocabulary of 512) whose tokens 510 and 511 are <think>
    and </think>, with THINKER_TEMPLATE, for reasoning parsers."""
    write(
        folder, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    for token, marker in zip(THINK_TOKENS, ("<think>", "</think>"), strict=True):
        del tokenizer["model"]["vocab"][f"w{token}"]
        tokenizer["model"]["vocab"][marker] = token
        tokenizer["added_tokens"].append({
            "id": token, "content": marker, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": THINKER_TEMPLATE,
        "bos_token": "w1", "eos_token": "w2", "model_max_length": 512,
    }))  # fmt: skip
    return folder


# sentence-transformers' modules, as Qwen3-Embedding lists them: last-token pooling, normalized.
EMBEDDER_MODULES = [
    {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
    for i, (path, kind) in enumerate(
        [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    )
]


def embedder(folder: Path) -> Path:
    """A tiny random Qwen3 (2 layers, hidden size 128, Matryoshka dimensions 32, 64 and 128) with
    Qwen3-Embedding's sentence-transformers modules and a tokenizer that closes each text with
    its EOS (w2), as Qwen3-Embedding's does."""
    write(folder, "Qwen3", **TINY_QWEN3, matryoshka_dimensions=[32, 64, 128])
    (folder / "modules.json").write_text(json.dumps(EMBEDDER_MODULES))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 128, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return _closed_by_eos(folder)


def classifier(folder: Path, labels: tuple[str, ...] = ("relevant",)) -> Path:
    """A tiny random Qwen3ForSequenceClassification (2 layers, hidden size 128) of `labels`,
    whose tokenizer closes a text with w2 and a pair's texts each with w2, as a cross-encoder's
    separates them."""
    write(folder, "Qwen3", "ForSequenceClassification", **TINY_QWEN3,
          id2label=dict(enumerate(labels)))  # fmt: skip
    return _closed_by_eos(folder)


def _closed_by_eos(folder: Path) -> Path:
    """The folder's tokenizer made to close a text with w2, and each text of a pair."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    a, b = ({"Sequence": {"id": side, "type_id": 0}} for side in ("A", "B"))
    end = {"SpecialToken": {"id": "w2", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [a, end], "pair": [a, end, b, end],
        "special_tokens": {"w2": {"id": "w2", "ids": [2], "tokens": ["w2"]}},
    }  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
    }))  # fmt: skip
    return folder


def lora(
    folder: Path, info: ModelInfo, rank: int = 8,
    modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
) -> Path:  # fmt: skip
    """A random PEFT LoRA folder for a model of `info`'s shape, adapting every layer's
    `modules` (PEFT's names): no transformers needed, so it fits any model the engine reads (a
    GGUF file's too)."""
    import torch
    from safetensors.torch import save_file

    every = module_shapes(info)
    shapes = {f"{'self_attn' if module in ATTENTION else 'mlp'}.{module}": every[module]
              for module in modules}  # fmt: skip
    torch.manual_seed(0)
    tensors = {}
    for layer in range(info.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": [m.split(".")[1] for m in shapes]}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


if __name__ == "__main__":
    write(Path(sys.argv[1]))
