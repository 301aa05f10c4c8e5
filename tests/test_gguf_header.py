"""`shared/gguf_header.py` reads what gguf's own reader reads: every value type, either byte
order, a custom alignment; and a model's tensors mapped by its table alone."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from turnstile.shared.gguf_header import read_header
from turnstile.shared.model_info import embedded_model_path


def assert_reads_as_gguf_does(path: Path) -> None:
    reader, header = gguf.GGUFReader(path), read_header(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(header.fields) == list(expected)
    for key, value in expected.items():
        got = header.fields[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert type(got[0]) is type(value[0]), key
    table = [(t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset))
             for t in reader.tensors]  # fmt: skip
    assert [(t.name, t.kind, list(t.dims), t.offset) for t in header.tensors] == table
    assert header.little_endian == (reader.byte_order == "I")


@pytest.mark.parametrize("order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_ggufs_reader_reads_it(
    tmp_path: Path, order: gguf.GGUFEndian
) -> None:
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=order)
    writer.add_custom_alignment(64)
    for kind, value in [
        (gguf.GGUFValueType.UINT8, 200), (gguf.GGUFValueType.INT8, -100),
        (gguf.GGUFValueType.UINT16, 60000), (gguf.GGUFValueType.INT16, -30000),
        (gguf.GGUFValueType.UINT32, 4_000_000_000), (gguf.GGUFValueType.INT32, -2_000_000_000),
        (gguf.GGUFValueType.UINT64, 2**63 + 5), (gguf.GGUFValueType.INT64, -(2**62)),
        (gguf.GGUFValueType.FLOAT32, 0.1), (gguf.GGUFValueType.FLOAT64, 1e-300),
        (gguf.GGUFValueType.BOOL, True), (gguf.GGUFValueType.STRING, "héllo ✓"),
    ]:  # fmt: skip
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1e-3])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.strings", ["a", "", "ü" * 300])
    writer.add_array("test.empty", [])
    writer.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("f16", np.ones((3, 5), dtype=np.float16))
    blocks = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34)  # two rows of one Q8_0 block
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf_does(path)
    assert read_header(path).tensors[1].offset % 64 == 0


@pytest.mark.slow
def test_the_embedded_model_reads_as_ggufs_reader_reads_it() -> None:
    """49,152 tokens and 48,900 merges: gguf's reader takes seconds, this a tenth of one."""
    assert_reads_as_gguf_does(embedded_model_path())


def test_what_is_not_gguf_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"model\.bin is not a GGUF file"):
        read_header(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(56))
    with pytest.raises(ValueError, match="GGUF version 1"):
        read_header(path)


def test_a_gguf_files_tensors_are_mapped_as_ggufs_reader_gives_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By the header's table alone (gguf's reader would raise), each tensor the same name,
    type, shape and bytes as the reader's: float32 norms, Q4_K and Q6_K blocks."""
    from gguf_models import LlamaShape, Q, write_llama_gguf

    from turnstile.executor_svc.model.gguf_tensors import gguf_tensors

    shape = LlamaShape(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=512)
    kinds = {"token_embd": Q.Q6_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
    kinds |= dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"), Q.Q4_K)
    model = write_llama_gguf(tmp_path / "random.gguf", shape, kinds)
    expected = gguf.GGUFReader(model).tensors

    def no_reader(*args: object) -> None:
        raise AssertionError("gguf's reader was used")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    arch, tensors = gguf_tensors(model)
    assert arch == "llama" and len(tensors) == len(expected) == 2 + 9 * shape.layers
    for got, want in zip(tensors, expected, strict=True):
        assert (got.name, got.tensor_type) == (want.name, want.tensor_type)
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data.view(np.uint8), want.data.view(np.uint8))
