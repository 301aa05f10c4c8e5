"""A GGUF tensor's blocks unpacked into a `QuantizedWeight`: codes one a byte, in the file's
element order, with a scale and an offset per group of inputs.

Q4_0, Q4_1 and Q8_0 give exactly the file's values. The K-quants keep their codes, and their
sub-block scales `d * sc` and `dmin * m` (float32 products in the file's dequantization) are
stored as fp16: a relative rounding of at most 2**-11 per scale, a tenth of what the int8
activations already round (see docs/benchmarks.md). Unpacked with torch, whose operations use
every core (docs/benchmarks.md, session 38)."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import torch

from turnstile.kernels.mxfp4_weights import fp4_weight
from turnstile.kernels.quantized_weights import BITS, Q, QuantizedWeight

CHUNK_ROWS = 2048


class Unkept(ValueError):
    """A tensor whose blocks cannot be kept as `QuantizedWeight` holds them."""


def from_gguf(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([rows, bytes], as `GGUFReader` gives them) unpacked, a chunk
    of rows at a time (a vocabulary's head unpacked whole takes several times its codes'
    bytes in transients); `Unkept` where float16 cannot hold their scales."""
    parts: list[torch.Tensor] = []
    for start in range(0, data.shape[0], CHUNK_ROWS):
        chunk = _unpacked(data[start : start + CHUNK_ROWS], kind)
        if not (torch.isfinite(chunk.scale).all() and torch.isfinite(chunk.offset).all()):
            raise Unkept(f"a {kind.name} block's scale or offset overflows float16")
        pieces = (chunk.codes, chunk.scale, chunk.offset)
        if not parts:
            parts = [t.new_empty(data.shape[0], *t.shape[1:]) for t in pieces]
        for whole, piece in zip(parts, pieces, strict=True):
            whole[start : start + len(piece)] = piece
    return QuantizedWeight(*parts, BITS[kind])


EXACT = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)  # what `dequantized` reads


def dequantized(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """The float32 values gguf's own dequantization gives, bit for bit (each code times its
    float32 scale is exact, and the offset is added once, as gguf adds it), a chunk of rows
    at a time with torch, into one tensor: on every core, where gguf's numpy takes one."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    out = torch.empty(data.shape[0], data.shape[1] // block_bytes * block_values)
    for start in range(0, data.shape[0], CHUNK_ROWS):
        chunk = _unpacked(data[start : start + CHUNK_ROWS], kind, torch.float32)
        values = out[start : start + len(chunk.codes)].view(len(chunk.codes), -1, chunk.group)
        torch.mul(chunk.codes.view(values.shape), chunk.scale[..., None], out=values)
        values.add_(chunk.offset[..., None])
    return out


def _unpacked(
    data: np.ndarray, kind: gguf.GGMLQuantizationType, dtype: torch.dtype = torch.float16
) -> QuantizedWeight:
    """Codes, with their scales and offsets in `dtype`."""
    rows = data.shape[0]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    with warnings.catch_warnings():  # a read-only map of the file: only read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    raw = raw.reshape(rows, -1, block_bytes)
    if kind == Q.MXFP4:  # a byte of e8m0 scale, then 16 of codes in llama.cpp's nibble order
        kept = fp4_weight(_nibbles(raw[..., 1:]).reshape(rows, -1), raw[..., 0])
        if kept is None:
            raise Unkept("an MXFP4 block's power of two is beyond float16's exact ones")
        return kept
    codes, scale, offset = _UNPACK[kind](raw)
    scale, offset = (t.reshape(rows, -1).to(dtype) for t in (scale, offset))
    return QuantizedWeight(codes.reshape(rows, -1), scale, offset, BITS[kind])


Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, offset (float32)


def _copied_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes read as `dtype`, copied: never a view of the file's read-only map."""
    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """A float16 field, as float32."""
    return _copied_as(raw, torch.float16)[..., 0].float()


def _q8_0(raw: torch.Tensor) -> Unpacked:
    """The int8 plus 128 (unsigned, as every other format), offset -128 d."""
    d = _fp16(raw[..., :2])
    codes = raw[..., 2:] ^ 0x80  # int8 v's byte, sign bit flipped: v + 128
    return codes, d, d * -128


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """llama.cpp's order: 32 bytes hold 32 values in their low nibbles, then 32 in the high."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _q4_0(raw: torch.Tensor) -> Unpacked:
    d = _fp16(raw[..., :2])
    return _nibbles(raw[..., 2:]), d, d * -8


def _q4_1(raw: torch.Tensor) -> Unpacked:
    return _nibbles(raw[..., 4:]), _fp16(raw[..., :2]), _fp16(raw[..., 2:4])


def _q4_k(raw: torch.Tensor) -> Unpacked:
    """Super-blocks of 256: d, dmin, eight 6-bit scales and mins, 4-bit codes; sub-block j's
    values are d * sc_j * code - dmin * m_j."""
    d, dmin = (_fp16(raw[..., i : i + 2])[..., None] for i in (0, 2))
    packed = raw[..., 4:16].reshape(-1, 12).numpy()  # a small part: gguf's own unpacking
    sc, m = (torch.from_numpy(t).reshape(*raw.shape[:2], 8).float()
             for t in gguf.quants.Q4_K.get_scale_min(packed))  # fmt: skip
    codes = _nibbles(raw[..., 16:].reshape(*raw.shape[:2], 4, 32))
    return codes, d * sc, -(dmin * m)


def _q6_k(raw: torch.Tensor) -> Unpacked:
    """Super-blocks of 256: 6-bit codes (low nibbles, then the 2 high bits of four codes a
    byte), an int8 scale per 16 and d; values d * sc * (code - 32)."""
    low = _nibbles(raw[..., :128].reshape(*raw.shape[:2], 2, 64))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (raw[..., 128:192].reshape(*raw.shape[:2], 2, 1, 32) >> shifts) & 3
    codes = low.reshape(*raw.shape[:2], 2, 4, 32) | (high << 4)
    sc = _copied_as(raw[..., 192:208], torch.int8).float()
    scale = _fp16(raw[..., 208:210])[..., None] * sc
    return codes, scale, scale * -32


_UNPACK = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
