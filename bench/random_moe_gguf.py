"""Writes a random-weight Qwen3-MoE GGUF file in Q4_K_M's formats, with the embedded model's
tokenizer, for serving figures of experts kept in their blocks (the time does not depend on the
weights, so they are random blocks: `requantize.random_blocks`):
    .venv/bin/python -m turnstile.bench.random_moe_gguf OUT.gguf
Its shape is a small Qwen3-MoE's: 16 layers of hidden 1024, 16 query and 4 KV heads of 64, 64
experts of 512 a layer, 8 a token (1.7B parameters, 0.3B active a token)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

from turnstile.bench.requantize import Q, random_blocks
from turnstile.shared.model_info import embedded_model_path

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 16, 4, 64
EXPERTS, TOP_K, INNER = 64, 8, 512


def write(path: Path) -> Path:
    source = gguf.GGUFReader(embedded_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_name("random-qwen3moe")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(4 * HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(INNER)
    seed = 0

    def blocks(name: str, kind: Q, *shape: int) -> None:
        """A matrix (or a stack of them) [..., rows, inputs] of random `kind` blocks."""
        nonlocal seed
        seed += 1
        rows = int(np.prod(shape[:-1]))
        data = random_blocks(kind, rows, shape[-1], seed).reshape(*shape[:-1], -1)
        writer.add_tensor(name, data, raw_dtype=kind)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, np.float32))

    blocks("token_embd.weight", Q.Q4_K, vocab, HIDDEN)
    blocks("output.weight", Q.Q6_K, vocab, HIDDEN)
    ones("output_norm.weight", HIDDEN)
    rng = np.random.default_rng(0)
    for layer in range(LAYERS):
        name = f"blk.{layer}."
        for norm, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN),
                           ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):  # fmt: skip
            ones(name + norm + ".weight", size)
        for part, rows, kind in (("attn_q", HEADS * HEAD_DIM, Q.Q4_K),
                                 ("attn_k", KV_HEADS * HEAD_DIM, Q.Q4_K),
                                 ("attn_v", KV_HEADS * HEAD_DIM, Q.Q6_K)):  # fmt: skip
            blocks(f"{name}{part}.weight", kind, rows, HIDDEN)
        blocks(f"{name}attn_output.weight", Q.Q4_K, HIDDEN, HEADS * HEAD_DIM)
        router = rng.normal(0, 0.05, (EXPERTS, HIDDEN)).astype(np.float32)
        writer.add_tensor(f"{name}ffn_gate_inp.weight", router)
        blocks(f"{name}ffn_gate_exps.weight", Q.Q4_K, EXPERTS, INNER, HIDDEN)
        blocks(f"{name}ffn_up_exps.weight", Q.Q4_K, EXPERTS, INNER, HIDDEN)
        blocks(f"{name}ffn_down_exps.weight", Q.Q6_K, EXPERTS, HIDDEN, INNER)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
