"""GPTQ's, AWQ's and compressed-tensors' int weights, as AutoGPTQ, AutoAWQ and llm-compressor write
them, unpacked into a
`QuantizedWeight` (codes one a byte, a scale and an offset per block of 32 inputs), which the
cpu backend multiplies as it does a GGUF file's blocks; or into their float values, where they
are not kept quantized or their groups are not runs of whole blocks (act-order GPTQ, groups of
16).

- GPTQ: `qweight` int32 [in * bits / 32, out], each holding 32 / bits consecutive inputs of one
  output, the first in the lowest bits; `scales` [groups, out]; `g_idx` [in], each input's
  group. Symmetric (the only GPTQ vLLM serves): each value is (code - 2 ** (bits - 1)) * scale,
  and `qzeros` is not read, as vLLM does not read it.
- AWQ (GEMM): `qweight` int32 [in, out / 8], eight consecutive outputs of one input, the lowest
  nibble first in the order 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` [groups, out / 8] alike; `scales`
  [groups, out]; each value (code - zero) * scale.
- compressed-tensors, pack-quantized: `weight_packed` int32 [out, in * bits / 32 rounded up],
  each holding 32 / bits consecutive inputs of one output, the first in the lowest bits, each
  code the value plus 2 ** (bits - 1); `weight_scale` [out, groups]; with zero points,
  `weight_zero_point` packed alike along the outputs, [out * bits / 32 rounded up, groups];
  `weight_g_idx` [in] with act order's groups. int-quantized: `weight` int8 [out, in], the value.

Kept quantized, a scale is the checkpoint's fp16 and the offset -zero * scale is rounded to
fp16 (exact for GPTQ's power-of-two zeros; for AWQ at most 2**-11 of it, as the K-quants'
sub-block scales are rounded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnstile.kernels.quantized_weights import BLOCK, QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of an int32 holds, lowest first
_AWQ_NIBBLE = [AWQ_ORDER.index(output) for output in range(8)]  # the nibble of each output


@dataclass(frozen=True, slots=True)
class Grouped:
    """A matrix's codes with a zero and a scale per group of inputs of each output."""

    codes: torch.Tensor  # uint8 [out, in]
    zeros: torch.Tensor  # [groups, out], integers
    scales: torch.Tensor  # [groups, out], the checkpoint's dtype
    groups: torch.Tensor  # int64 [in]: each input's group
    bits: int

    def values(self) -> torch.Tensor:
        """float32 [out, in]: (code - zero) * scale, exactly."""
        zeros, scales = self.zeros.T[:, self.groups], self.scales.T[:, self.groups]
        return (self.codes.float() - zeros.float()) * scales.float()

    def kept(self) -> QuantizedWeight | None:
        """As a `QuantizedWeight`, where each group is a run of whole blocks of 32 inputs and
        its scale an fp16; else None."""
        inputs = self.codes.shape[1]
        width = inputs // self.scales.shape[0]
        runs = torch.equal(self.groups, torch.arange(inputs) // width)
        scales = self.scales.T.half()
        if not (runs and width % BLOCK == 0 and torch.equal(scales.float(), self.scales.T.float())):
            return None
        offsets = (-(self.zeros.T.float() * scales.float())).half()
        if not torch.isfinite(offsets).all():
            return None
        per_block = width // BLOCK
        return QuantizedWeight(
            self.codes.contiguous(),
            scales.repeat_interleave(per_block, dim=1).contiguous(),
            offsets.repeat_interleave(per_block, dim=1).contiguous(),
            self.bits,
        )


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 32 / bits]: each int32's fields, the lowest first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def gptq(
    qweight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, bits: int
) -> Grouped:
    rows, out = qweight.shape
    inputs = rows * 32 // bits
    codes = _fields(qweight.T, bits).reshape(out, inputs)
    if g_idx is None:
        g_idx = torch.arange(inputs) // (inputs // scales.shape[0])
    if g_idx.shape != (inputs,) or scales.shape[1] != out:
        raise ValueError(f"g_idx {tuple(g_idx.shape)} or scales {tuple(scales.shape)} do not fit "
                         f"qweight {tuple(qweight.shape)} of {bits}-bit codes")  # fmt: skip
    zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32)
    return Grouped(codes, zeros, scales, g_idx.long(), bits)


def compressed(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    shape: tuple[int, int],
    bits: int,
    group: int,
) -> Grouped:
    """pack-quantized: `scales` [out, groups], `group` inputs a scale (0: a row)."""
    out, inputs = shape
    codes = _fields(packed, bits).reshape(out, -1)[:, :inputs]
    if zeros is not None:
        zeros = _fields(zeros.T, bits).reshape(scales.shape[1], -1)[:, :out]
    return _signed(codes, scales, zeros, g_idx, group, bits)


def int8_codes(
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group: int,
    bits: int,
) -> Grouped:
    """int-quantized: `weight` int8 [out, in], `scales` [out, groups] or one, `zeros` (int8
    values, not packed) alike."""
    half = 1 << (bits - 1)
    if zeros is not None:
        zeros = zeros.reshape(-1, scales.shape[-1]).int().T + half
    return _signed(weight.int() + half, scales, zeros, g_idx, group, bits)


def _signed(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group: int,
    bits: int,
) -> Grouped:
    """Codes offset by 2 ** (bits - 1), as compressed-tensors stores them, with zeros alike
    ([groups, out]; None: symmetric)."""
    out, inputs = codes.shape
    scales = scales.reshape(-1, scales.shape[-1]).expand(out, -1).T
    zeros = torch.full((1, 1), 1 << (bits - 1)) if zeros is None else zeros
    if g_idx is None:
        g_idx = torch.arange(inputs) // (group or inputs)
    if g_idx.shape != (inputs,) or int(g_idx.max()) >= scales.shape[0]:
        raise ValueError(f"scales {tuple(scales.shape)} or zeros do not fit a weight of "
                         f"{tuple(codes.shape)} in groups of {group}")  # fmt: skip
    return Grouped(codes.to(torch.uint8), zeros.expand_as(scales), scales, g_idx.long(), bits)


def awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Grouped:
    inputs, packed = qweight.shape
    out = packed * 8
    if scales.shape[1] != out or qzeros.shape != (scales.shape[0], packed):
        raise ValueError(f"qzeros {tuple(qzeros.shape)} or scales {tuple(scales.shape)} do not "
                         f"fit qweight {tuple(qweight.shape)}")  # fmt: skip
    codes = _fields(qweight, 4)[..., _AWQ_NIBBLE].reshape(inputs, out).T
    zeros = _fields(qzeros, 4)[..., _AWQ_NIBBLE].reshape(-1, out)
    groups = torch.arange(inputs) // (inputs // scales.shape[0])
    return Grouped(codes, zeros, scales, groups, 4)
