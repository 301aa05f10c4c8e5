"""Experts kept in their GGUF blocks (`kernels/native/quantized_experts.c`) against the same
arithmetic in torch (`quantized_weights.reference_linear` a product), in every block format
(gpt-oss's MXFP4 too) and on every ISA this CPU runs; a token's bits alone and among others."""

from __future__ import annotations

import pytest
import torch

from turnstile.executor_svc.model.experts import clamped_swiglu
from turnstile.kernels import cpu_native, quantized_experts
from turnstile.kernels.quantized_weights import FP4, FP4_CODES, QuantizedWeight, reference_linear

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="needs the native kernels")
EXPERTS, HIDDEN, INNER, TOP_K = 6, 64, 96, 2


def _matrix(out: int, inputs: int, bits: int, generator: torch.Generator) -> QuantizedWeight:
    """Random codes of `bits`, their scales and offsets as a GGUF format's (Q6_K: groups of 16,
    offset -32 d)."""
    group = 16 if bits == 6 else 32
    nibbles = torch.randint(0, 16, (out, inputs), generator=generator)
    codes = torch.randint(0, 2**bits, (out, inputs), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(out, inputs // group, generator=generator) * 0.02 + 0.001).half()
    offset = -scale * 2 ** (bits - 1) if bits in (6, 8) else -scale * 8
    if bits == FP4:  # MXFP4's: e2m1 codes through their table, m = -12 d
        codes, offset = FP4_CODES[nibbles], -scale * 12
    return QuantizedWeight(codes, scale, offset.half(), bits)


def _experts(bits: tuple[int, int, int], glu: str, biases: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))
    matrices = [[_matrix(*shape, b, generator) for _ in range(EXPERTS)]
                for shape, b in zip(shapes, bits, strict=True)]  # fmt: skip
    gate_up_bias = torch.randn(EXPERTS, 2 * INNER, generator=generator) if biases else None
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=generator) if biases else None
    return matrices, gate_up_bias, down_bias


def _native(matrices, gate_up_bias, down_bias, glu: str) -> quantized_experts.PackedExperts:
    return quantized_experts.PackedExperts(tuple(matrices), (gate_up_bias, down_bias), glu,
                                           1.702, 7.0)  # fmt: skip


def _reference(x, chosen, routed, matrices, gate_up_bias, down_bias, glu: str) -> torch.Tensor:
    gates, ups, downs = matrices
    out = torch.zeros(x.shape)
    for t in range(len(x)):
        for c in range(chosen.shape[1]):
            e = int(chosen[t, c])
            gate, up = (reference_linear(x[t : t + 1], m[e]) for m in (gates, ups))
            if gate_up_bias is not None:
                gate, up = gate + gate_up_bias[e, :INNER], up + gate_up_bias[e, INNER:]
            if glu == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                act = clamped_swiglu(gate, up, 1.702, 7.0)
            down = reference_linear(act, downs[e])
            if down_bias is not None:
                down = down + down_bias[e]
            out[t] += routed[t, c] * down[0]
    return out


def _routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K]
                          for _ in range(tokens)])  # fmt: skip
    routed = torch.rand(tokens, TOP_K, generator=generator)
    return x, chosen, routed


@pytest.mark.parametrize(
    ("bits", "glu", "biases"),
    [
        ((4, 4, 6), "silu", False),
        ((8, 8, 8), "silu", False),
        ((6, 4, 4), "clamped_swiglu", True),
        ((FP4, FP4, FP4), "clamped_swiglu", True),
    ],
)
def test_the_native_experts_compute_what_torch_computes_from_the_blocks(bits, glu, biases) -> None:
    matrices, gate_up_bias, down_bias = _experts(bits, glu, biases)
    experts = _native(matrices, gate_up_bias, down_bias, glu)
    x, chosen, routed = _routing(13)
    expected = _reference(x, chosen, routed, matrices, gate_up_bias, down_bias, glu)
    results = [experts(x, chosen, routed, isa)
               for isa in cpu_native.usable_isas()]  # fmt: skip
    for result in results:
        torch.testing.assert_close(result, expected, rtol=2e-4, atol=2e-4)
        assert torch.equal(result, results[0])  # every ISA's tiles: the same float steps


def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it() -> None:
    matrices, gate_up_bias, down_bias = _experts((4, 4, 6), "silu", False)
    experts = _native(matrices, gate_up_bias, down_bias, "silu")
    x, chosen, routed = _routing(61, seed=2)
    batched = experts(x, chosen, routed)
    for t in (0, 17, 60):
        alone = experts(x[t : t + 1], chosen[t : t + 1], routed[t : t + 1])
        assert torch.equal(alone[0], batched[t])


def test_an_expert_out_of_range_is_refused() -> None:
    matrices, gate_up_bias, down_bias = _experts((8, 8, 8), "silu", False)
    experts = _native(matrices, gate_up_bias, down_bias, "silu")
    x, chosen, routed = _routing(2)
    chosen[1, 0] = EXPERTS
    with pytest.raises(ValueError, match="out of range 0-5"):
        experts(x, chosen, routed)
