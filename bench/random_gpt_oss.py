"""Writes a random-weight gpt-oss checkpoint as OpenAI ships gpt-oss (its experts in MXFP4,
the rest bfloat16), with a Hugging Face tokenizer's files copied beside it, for figures where
the time does not depend on the weights:
    .venv/bin/python -m turnstile.bench.random_gpt_oss OUT_DIR TOKENIZER_DIR [LAYERS=4]
Its layers are gpt-oss-20b's (hidden 2880, 64 query and 8 KV heads of 64, 32 experts of 2880,
4 a token, every other layer sliding over 128 tokens), fewer of them: 4 by default (2.0B
parameters, 0.5 GB a layer of experts in MXFP4)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, INNER = 2880, 64, 8, 64, 32, 4, 2880
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write(out: Path, tokenizer: Path, layers: int = 4) -> Path:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    draw = torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=draw) * std).to(torch.bfloat16)

    def mxfp4(name: str, experts: int, rows: int, inputs: int) -> dict[str, torch.Tensor]:
        """Random e2m1 codes, and powers of two 2^-8 to 2^-3 (values up to 0.75)."""
        blocks = torch.randint(0, 256, (experts, rows, inputs // 32, 16), dtype=torch.uint8,
                               generator=draw)  # fmt: skip
        scales = torch.randint(119, 125, (experts, rows, inputs // 32), dtype=torch.uint8,
                               generator=draw)  # fmt: skip
        return {name + "_blocks": blocks, name + "_scales": scales}

    weights = {
        "model.embed_tokens.weight": normal(vocab, HIDDEN),
        "lm_head.weight": normal(vocab, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    for i in range(layers):
        layer = f"model.layers.{i}."
        attn, mlp = layer + "self_attn.", layer + "mlp."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{layer}{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            weights[f"{attn}{part}_proj.weight"] = normal(rows * HEAD_DIM, HIDDEN)
            weights[f"{attn}{part}_proj.bias"] = normal(rows * HEAD_DIM, std=0.5)
        weights[attn + "o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        weights[attn + "o_proj.bias"] = normal(HIDDEN, std=0.5)
        weights[attn + "sinks"] = normal(HEADS, std=0.5)
        weights[mlp + "router.weight"] = normal(EXPERTS, HIDDEN)
        weights[mlp + "router.bias"] = normal(EXPERTS, std=0.5)
        weights |= mxfp4(mlp + "experts.gate_up_proj", EXPERTS, 2 * INNER, HIDDEN)
        weights |= mxfp4(mlp + "experts.down_proj", EXPERTS, HIDDEN, INNER)
        weights[mlp + "experts.gate_up_proj_bias"] = normal(EXPERTS, 2 * INNER, std=0.5)
        weights[mlp + "experts.down_proj_bias"] = normal(EXPERTS, HIDDEN, std=0.5)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=layers,
        head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=128,
        max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                             rope_theta=1.5e5, beta_fast=32.0, beta_slow=1.0, truncate=False),
    )  # fmt: skip
    config.architectures = ["GptOssForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.quantization_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return out


if __name__ == "__main__":
    write(Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:4]))
