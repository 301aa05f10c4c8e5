"""A GGUF file's tensors without parsing its metadata again: gguf's reader parses every key before
the tensors (the tokenizer's 49,152 strings among them: 2.5 of an executor's 3.6 s start here),
so the tensors' table (name, type, shape, offset) is cached beside the model's other derived
files, keyed by its content, and their data mapped from the file as gguf's reader maps it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import msgspec
import numpy as np
from gguf import GGMLQuantizationType as Kind

from turnstile.shared.model_info import derived_path, write_derived

# Types gguf's reader gives as typed arrays; the others as each row's bytes.
_PLAIN = {Kind.F16: np.float16, Kind.F32: np.float32, Kind.F64: np.float64, Kind.I8: np.int8,
          Kind.I16: np.int16, Kind.I32: np.int32, Kind.I64: np.int64}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    tensor_type: Kind
    data: np.ndarray  # as gguf's `ReaderTensor.data`


class Table(msgspec.Struct, frozen=True):
    architecture: str
    tensors: list[tuple[str, int, list[int], int]]  # name, type, dims, offset in the file


def gguf_tensors(path: Path) -> tuple[str, list[Tensor]]:
    """The file's architecture and its tensors, in the file's order."""
    cached = derived_path(path, "tensors.json", (__file__,))
    if cached.exists():
        table = msgspec.json.decode(cached.read_bytes(), type=Table)
    else:
        reader = gguf.GGUFReader(path)
        table = Table(
            str(reader.fields["general.architecture"].contents()),
            [(t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset))
             for t in reader.tensors],
        )  # fmt: skip
        if reader.byte_order != "I":  # a file of the other byte order: gguf's reader swaps
            tensors = [Tensor(t.name, t.tensor_type, t.data) for t in reader.tensors]
            return table.architecture, tensors
        write_derived(cached, msgspec.json.encode(table))
    mapped = np.memmap(path, mode="r")
    return table.architecture, [_tensor(mapped, *entry) for entry in table.tensors]


def _tensor(mapped: np.ndarray, name: str, kind: int, dims: list[int], offset: int) -> Tensor:
    """As gguf's reader builds a tensor: dims reversed; a block type's rows as bytes."""
    kind, shape = Kind(kind), tuple(reversed(dims))
    block, size = gguf.GGML_QUANT_SIZES[kind]
    dtype = _PLAIN.get(kind, np.uint8)
    if dtype is np.uint8:
        shape = gguf.quant_shape_to_byte_shape(shape, kind)
    count = math.prod(dims) * size // block
    return Tensor(name, kind, mapped[offset : offset + count].view(dtype).reshape(shape))
