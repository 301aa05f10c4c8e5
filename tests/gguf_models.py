"""Llama-shaped GGUF files written with the `gguf` package, their matrices random blocks of the
block types a test names (gguf cannot quantize K-quants itself, so blocks are drawn: random
codes and sub-block scales, super-block scales about a trained model's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from turnstile.bench.requantize import SCALES, Q, random_blocks

__all__ = ["SCALES", "LlamaShape", "Q", "random_blocks", "write_llama_gguf"]


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return (
            self.layers * (attention + 3 * self.hidden * self.intermediate)
            + self.vocab * self.hidden
        )


def write_llama_gguf(
    path: Path, shape: LlamaShape, kinds: dict[str, gguf.GGMLQuantizationType]
) -> Path:
    """A tied-embedding Llama; `kinds` names each matrix's block type by its GGUF name's tail
    ("attn_q", "ffn_down", "token_embd", ...)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("random-llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(shape.vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    seed = 0

    def matrix(name: str, kind_name: str, rows: int, inputs: int) -> None:
        nonlocal seed
        seed += 1
        kind = kinds[kind_name]
        writer.add_tensor(name, random_blocks(kind, rows, inputs, seed), raw_dtype=kind)

    matrix("token_embd.weight", "token_embd", shape.vocab, shape.hidden)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    for layer in range(shape.layers):
        name = f"blk.{layer}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{name}{norm}.weight", np.ones(shape.hidden, np.float32))
        for part, rows, inputs in (
            ("attn_q", shape.hidden, shape.hidden),
            ("attn_k", kv, shape.hidden),
            ("attn_v", kv, shape.hidden),
            ("attn_output", shape.hidden, shape.hidden),
            ("ffn_gate", shape.intermediate, shape.hidden),
            ("ffn_up", shape.intermediate, shape.hidden),
            ("ffn_down", shape.hidden, shape.intermediate),
        ):
            matrix(f"{name}{part}.weight", part, rows, inputs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
