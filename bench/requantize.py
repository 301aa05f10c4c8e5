"""The embedded GGUF's layer matrices stored again in another block format, so that each format
the quantized path reads can be measured on real weights (`turnstile bench quality`).

The `gguf` package quantizes Q4_0, Q4_1 and Q8_0 but not the K-quants; `q4_k` and `q6_k` below
write their blocks as llama.cpp lays them out (its dequantization, which `gguf` has, reads them
back: tests/test_quality_formats.py), with plain min-max scales rather than llama.cpp's search.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's fp16 scales


def random_blocks(
    kind: gguf.GGMLQuantizationType, rows: int, inputs: int, seed: int = 0
) -> np.ndarray:
    """[rows, bytes] of `kind` blocks: random bytes, then plausible fp16 scales."""
    rng = np.random.default_rng(seed)
    elements, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, inputs // elements, size), dtype=np.uint8)
    for start in SCALES[kind]:
        scale = rng.uniform(1e-5, 1e-4, (rows, inputs // elements, 1)).astype(np.float16)
        raw[..., start : start + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _codes(x: np.ndarray, step: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """round((x + offset) / step) within [0, top]; 0 where the step is 0."""
    safe = np.where(step == 0, 1, step)
    return np.clip(np.rint((x + offset) / safe), 0, top).astype(np.uint8) * (step != 0)


def q4_k(values: np.ndarray) -> np.ndarray:
    """[rows, n] float32 (n a multiple of 256) as Q4_K blocks: per 32 values 4-bit codes, a scale
    d * sc and an offset -dmin * m, sc and m 6 bits each, d and dmin float16 per 256."""
    x = values.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=2), 0)
    scale, offset = (x.max(axis=2) - low) / 15, -low
    d, dmin = _half(scale.max(axis=1) / 63), _half(offset.max(axis=1) / 63)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step, shift = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = _codes(x, step, shift, 15).reshape(-1, 4, 2, 32)  # sub-blocks in pairs of 64 values
    scales = np.concatenate(
        [sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
         (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1,
    )  # fmt: skip
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    heads = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)
    return np.concatenate([heads, scales, qs], axis=1).reshape(values.shape[0], -1)


def q6_k(values: np.ndarray) -> np.ndarray:
    """[rows, n] float32 (n a multiple of 256) as Q6_K blocks: per 16 values 6-bit codes less 32
    and an int8 scale, times a float16 d per 256."""
    x = values.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=2) / 31
    d = _half(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[:, None]), 0, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = _codes(x, step, 32 * step, 63).reshape(-1, 2, 4, 32)  # halves of 128: 4 runs of 32
    low = q & 15
    ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], 2)
    qh = (
        (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    )
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
             d.astype(np.float16).view(np.uint8).reshape(-1, 2)]  # fmt: skip
    return np.concatenate(parts, axis=1).reshape(values.shape[0], -1)


def quantize(values: np.ndarray, kind: Q) -> np.ndarray:
    """[rows, n] float32 as blocks of `kind`: the K-quants here, the others by `gguf`."""
    if kind in (Q.Q4_K, Q.Q6_K):
        return (q4_k if kind == Q.Q4_K else q6_k)(values)
    return gguf.quants.quantize(values, kind)


Choice = Callable[[str, int], Q | None]  # (tensor name, inputs a row) -> its new type


def storable(kind: Q, inputs: int) -> bool:
    """Whether rows of `inputs` values are whole blocks of `kind`."""
    return inputs % gguf.GGML_QUANT_SIZES[kind][0] == 0


def everywhere(kind: Q) -> Choice:
    """`kind` for every layer matrix whose rows are whole blocks of it."""
    return lambda name, inputs: kind if storable(kind, inputs) else None


def requantize(source: Path, target: Path, choose: Choice) -> Path:
    """`source` with each layer matrix stored in the type `choose` names for it (from its
    values dequantized); every other tensor, and all metadata, as they are."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        kind_of = field.types[0]
        sub_type = field.types[-1] if kind_of == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_of, sub_type=sub_type)
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # numpy's order: [rows, inputs]
        matrix = tensor.name.startswith("blk.") and len(shape) == 2
        kind = choose(tensor.name, shape[1]) if matrix else None
        if kind is not None:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            writer.add_tensor(tensor.name, quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
