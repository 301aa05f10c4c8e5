"""A GGUF file's tensors, their data mapped from the file as gguf's reader maps it, by the table
`shared/gguf_header.py` reads (gguf's reader parses every value first: 4.4 s for SmolLM2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Kind

from turnstile.shared.gguf_header import TensorInfo, read_header

# Types gguf's reader gives as typed arrays; the others as each row's bytes.
_PLAIN = {Kind.F16: np.float16, Kind.F32: np.float32, Kind.F64: np.float64, Kind.I8: np.int8,
          Kind.I16: np.int16, Kind.I32: np.int32, Kind.I64: np.int64}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    tensor_type: Kind
    data: np.ndarray  # as gguf's `ReaderTensor.data`


def gguf_tensors(path: Path) -> tuple[str, list[Tensor]]:
    """The file's architecture and its tensors, in the file's order."""
    header = read_header(path)
    mapped = np.memmap(path, mode="r")
    order = "<" if header.little_endian else ">"
    architecture = str(header.fields["general.architecture"])
    return architecture, [_tensor(mapped, info, order) for info in header.tensors]


def _tensor(mapped: np.ndarray, info: TensorInfo, order: str) -> Tensor:
    """As gguf's reader builds a tensor: dims reversed; a block type's rows as bytes; a typed
    array in the file's byte order."""
    kind, shape = Kind(info.kind), tuple(reversed(info.dims))
    block, size = gguf.GGML_QUANT_SIZES[kind]
    dtype = np.dtype(_PLAIN.get(kind, np.uint8)).newbyteorder(order)
    if dtype == np.uint8:
        shape = gguf.quant_shape_to_byte_shape(shape, kind)
    count = math.prod(info.dims) * size // block
    data = mapped[info.offset : info.offset + count].view(dtype).reshape(shape)
    return Tensor(info.name, kind, data)
