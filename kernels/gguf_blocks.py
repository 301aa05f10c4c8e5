"""A GGUF tensor's blocks unpacked into a `QuantizedWeight`: codes one a byte, in the file's
element order, with a scale and an offset per group of inputs.

Q4_0, Q4_1 and Q8_0 give exactly the file's values. The K-quants keep their codes, and their
sub-block scales `d * sc` and `dmin * m` (float32 products in the file's dequantization) are
stored as fp16: a relative rounding of at most 2**-11 per scale, a tenth of what the int8
activations already round (see docs/benchmarks.md)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from turnstile.kernels.quantized_weights import BITS, Q, QuantizedWeight


def from_gguf(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([rows, bytes], as `GGUFReader` gives them) unpacked."""
    rows = data.shape[0]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)
    codes, scale, offset = _UNPACK[kind](raw)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError(f"a {kind.name} block's scale or offset overflows float16")
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, -1))),
        BITS[kind],
    )


Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes, scale, offset (fp16)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0]


def _q8_0(raw: np.ndarray) -> Unpacked:
    """The int8 plus 128 (unsigned, as every other format), offset -128 d."""
    d = _fp16(raw[..., :2])
    codes = raw[..., 2:] ^ np.uint8(0x80)  # int8 v's byte, sign bit flipped: v + 128
    return codes, d, (d.astype(np.float32) * -128).astype(np.float16)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """llama.cpp's order: 32 bytes hold 32 values in their low nibbles, then 32 in the high."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def _q4_0(raw: np.ndarray) -> Unpacked:
    d = _fp16(raw[..., :2])
    return _nibbles(raw[..., 2:]), d, d * np.float16(-8)


def _q4_1(raw: np.ndarray) -> Unpacked:
    return _nibbles(raw[..., 4:]), _fp16(raw[..., :2]), _fp16(raw[..., 2:4])


def _q4_k(raw: np.ndarray) -> Unpacked:
    """Super-blocks of 256: d, dmin, eight 6-bit scales and mins, 4-bit codes; sub-block j's
    values are d * sc_j * code - dmin * m_j."""
    d, dmin = (_fp16(raw[..., i : i + 2]).astype(np.float32)[..., None] for i in (0, 2))
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
    sc, m = (t.reshape(*raw.shape[:2], 8).astype(np.float32) for t in (sc, m))
    codes = _nibbles(raw[..., 16:].reshape(*raw.shape[:2], 4, 32))
    return codes, (d * sc).astype(np.float16), (-(dmin * m)).astype(np.float16)


def _q6_k(raw: np.ndarray) -> Unpacked:
    """Super-blocks of 256: 6-bit codes (low nibbles, then the 2 high bits of four codes a
    byte), an int8 scale per 16 and d; values d * sc * (code - 32)."""
    low = _nibbles(raw[..., :128].reshape(*raw.shape[:2], 2, 64))
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = (raw[..., 128:192].reshape(*raw.shape[:2], 2, 1, 32) >> shifts) & 3
    codes = low.reshape(*raw.shape[:2], 2, 4, 32) | (high << 4)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    scale = (_fp16(raw[..., 208:210]).astype(np.float32)[..., None] * sc).astype(np.float16)
    return codes, scale, scale * np.float16(-32)


_UNPACK = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
