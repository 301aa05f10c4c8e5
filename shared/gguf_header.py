"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf's `GGUFReader` builds numpy views of every part of every value (a vocabulary's strings one
by one): 4.4 s for SmolLM2's file on an AMD EPYC core, 19 s of the test suite's GGUF reads, paid
at every new model's first start by each process that reads it. This reads the same values
with `struct` from the header's bytes, in either byte order (docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF's value types that are numbers (their struct codes), and the bool.
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    kind: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # as stored: the innermost first
    offset: int  # of its data, from the file's start


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, Any]  # each value as gguf's `ReaderField.contents()` gives it
    tensors: list[TensorInfo]  # in the file's order
    little_endian: bool


class _Cursor:
    def __init__(self, data: memoryview, order: str) -> None:
        self.data, self.order, self.at = data, order, 0

    def number(self, code: str) -> Any:
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.number("Q")
        self.at += length
        return bytes(self.data[self.at - length : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.number(_NUMBERS[kind])
        item, count = self.number("I"), self.number("Q")
        if item in _NUMBERS:  # one numpy read for the whole array
            dtype = np.dtype(_NUMBERS[item]).newbyteorder(self.order)
            values = np.frombuffer(self.data, dtype, count, self.at)
            self.at += values.nbytes
            return values.tolist()
        if item == _STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """A vocabulary's tens of thousands of strings: the loop kept to its least."""
        data, at, length = self.data, self.at, struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(count):
            (size,) = length(data, at)
            at += 8 + size
            out.append(str(data[at - size : at], "utf-8", "replace"))
        self.at = at
        return out


def read_header(path: Path) -> GGUFHeader:
    """The fields and the tensor table of the GGUF file at `path` (versions 2 and 3)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = memoryview(mapped)
        try:
            return _parse(data, path.name)
        finally:
            data.release()


def _parse(data: memoryview, name: str) -> GGUFHeader:
    if bytes(data[:4]) != _MAGIC:
        raise ValueError(f"{name} is not a GGUF file")
    # The version is a small number: read the wrong way round, its low half is zero.
    little = struct.unpack_from("<I", data, 4)[0] & 0xFFFF != 0
    cursor = _Cursor(data, "<" if little else ">")
    cursor.at = 4
    version = cursor.number("I")
    if version not in (2, 3):
        raise ValueError(f"{name}: GGUF version {version}, where 2 and 3 are read")
    tensor_count, field_count = cursor.number("Q"), cursor.number("Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.number("I"))
    table = []
    for _ in range(tensor_count):
        tensor = cursor.string()
        dims = tuple(cursor.number("Q") for _ in range(cursor.number("I")))
        table.append((tensor, dims, cursor.number("I"), cursor.number("Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cursor.at // alignment) * alignment
    tensors = [TensorInfo(n, kind, dims, start + offset) for n, dims, kind, offset in table]
    return GGUFHeader(fields, tensors, little)
