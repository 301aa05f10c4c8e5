"""Rotary position embedding: each position's rotation of each frequency, as cos + i sin.

The plain frequencies are computed here, and those a GGUF file divides by its factors; a
scaled RoPE (linear, llama3, yarn, longrope) takes its frequencies and its attention factor
from transformers' own functions, so it is exactly what the model was trained with
(transformers is imported only for such a model). Dynamic NTK,
whose frequencies grow with the sequence, rotates each position as transformers rotates a
sequence's newest token there (`_dynamic_ntk_angles`).
"""

from __future__ import annotations

from typing import TypeVar

import torch

from turnstile.shared.model_info import ModelInfo
from turnstile.shared.model_support import FREQUENCY_FACTORS, rope_type

T = TypeVar("T")


def rope_rotations(info: ModelInfo) -> torch.Tensor:
    """[max_model_len, head_dim / 2] complex64: position p's rotation of frequency i, scaled
    by the attention factor (yarn's; 1 otherwise), which multiplies both q and k as in
    transformers; where RoPE rotates a head's first `rotary_dim` dims only, the identity for
    the pairs of the others."""
    rotations = _rotary_rotations(info)
    unrotated = info.head_dim // 2 - rotations.shape[1]
    if unrotated:
        rotations = torch.cat([rotations, rotations.new_ones(len(rotations), unrotated)], dim=1)
    return rotations


def _rotary_rotations(info: ModelInfo) -> torch.Tensor:
    positions = torch.arange(info.max_model_len, dtype=torch.float32)
    if rope_type(info.rope_scaling) == "dynamic":
        angles, factor = _dynamic_ntk_angles(info, positions), 1.0
    else:
        inv_freq, factor = _frequencies(info)
        angles = torch.outer(positions, inv_freq.float())
    rotations = torch.polar(torch.full_like(angles, factor), angles)
    original = (info.rope_scaling or {}).get("original_max_position_embeddings")
    if rope_type(info.rope_scaling) == "longrope" and original < info.max_model_len:
        # transformers takes the long factors once the sequence is longer than the original
        # context: a token at position p >= original is rotated by them.
        inv_freq, factor = _frequencies(info, seq_len=original + 1)
        angles = torch.outer(positions[original:], inv_freq.float())
        rotations[original:] = torch.polar(torch.full_like(angles, factor), angles)
    return rotations


def _dynamic_ntk_angles(info: ModelInfo, positions: torch.Tensor) -> torch.Tensor:
    """Position p's angles at the frequencies of a sequence of max(p + 1, original) tokens:
    transformers' `_compute_dynamic_ntk_parameters` in float32, as `generate` calls it (with
    the length a tensor), for every length at once. This is what `generate` gives a token
    decoded at p (its frequencies grow with the sequence); a prompt longer than the original
    context is rotated whole by the frequencies of its length there, here position by
    position, so that a position's rotation never depends on how its sequence was chunked or
    batched."""
    scaling = info.rope_scaling or {}
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    dim = info.rotary_dim or info.head_dim
    tokens = (positions + 1).clamp(min=original)
    base = info.rope_theta * ((factor * tokens / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return positions[:, None] * inv_freq


def _frequencies(info: ModelInfo, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = rope_type(info.rope_scaling)
    dim = info.rotary_dim or info.head_dim
    if kind in ("default", FREQUENCY_FACTORS):
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        inv_freq = 1.0 / (info.rope_theta**exponents)
        if kind == FREQUENCY_FACTORS:  # a GGUF file's Llama 3.1 scaling
            inv_freq /= torch.tensor(info.rope_scaling["factors"], dtype=torch.float64)
        return inv_freq, 1.0
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PretrainedConfig(
        hidden_size=info.hidden_size,
        num_attention_heads=info.num_heads,
        head_dim=info.head_dim,
        max_position_embeddings=info.max_model_len,
        rope_parameters={**(info.rope_scaling or {}), "rope_type": kind,
                         "rope_theta": info.rope_theta,
                         "partial_rotary_factor": dim / info.head_dim},
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len)
    return inv_freq, float(factor)


def rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """RoPE on heads whose dims are interleaved pairs (`interleave_rotary_halves`)."""
    pairs = x.unflatten(-1, (-1, 2))
    if pairs.dtype != torch.float32:  # no complex type pairs with bf16
        pairs = pairs.float()
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * rotations).flatten(-2)
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def interleave_rotary_halves(weight: T, heads: int, head_dim: int, rotary: int = 0) -> T:
    """Reorder each head's output dims from (0..d/2-1, d/2..d-1) to (0, d/2, 1, d/2+1, ...),
    d the `rotary` first dims (0: all; the others stay in place).

    RoPE rotates dims i and i + d/2 together; side by side they are one complex number, so one
    complex multiply rotates a whole head. Q and K are permuted alike, which leaves every q.k,
    and so attention, unchanged; V is not touched. `weight`: anything indexed by rows."""
    rows = torch.arange(heads * head_dim).view(heads, head_dim)[:, rotary_order(head_dim, rotary)]
    return weight[rows.flatten()]  # type: ignore[index]


def rotary_order(head_dim: int, rotary: int = 0) -> torch.Tensor:
    rotary = rotary or head_dim
    pairs = torch.arange(rotary).view(2, -1).t().reshape(-1)
    return torch.cat([pairs, torch.arange(rotary, head_dim)])
