"""#25's quality bound for every block format the quantized path reads, on real weights: the
embedded model's layers stored again in Q4_0, Q8_0, Q4_K and Q6_K (`bench/requantize.py`),
whose K-quant writers must lay blocks out as llama.cpp reads them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from turnstile.bench.requantize import Q, quantize, requantize
from turnstile.kernels import cpu_native
from turnstile.shared.gguf_header import read_header
from turnstile.shared.model_info import embedded_model_path


@pytest.mark.parametrize(("kind", "bound"), [(Q.Q4_K, 0.1), (Q.Q6_K, 0.025)])
def test_k_quant_blocks_read_back_through_ggufs_own_dequantization(kind: Q, bound: float) -> None:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((6, 768)) * 0.05).astype(np.float32)
    values[0, :32] += 0.3  # a sub-block far from zero (Q4_K's offset)
    values[1, 256:512] = 0  # a whole block of zeros: scales of 0, read back as 0
    blocks = quantize(values, kind)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 3 * block_bytes)
    back = gguf.quants.dequantize(blocks, kind)
    assert back.shape == values.shape and np.all(back[1, 256:512] == 0)
    # A mean error of a few percent of the values (4 bits: ~8%, 6 bits: ~2%); a wrong layout
    # would read codes back at other places, errors as large as the values.
    error = np.abs(back - values).mean() / np.abs(values).mean()
    assert error < bound, error


def _every_format(name: str, inputs: int) -> Q:
    """Down projections (1,536 inputs, whole super-blocks) in Q4_K or Q6_K by layer; the other
    matrices (576 inputs) in Q4_0, Q8_0 or Q4_1."""
    layer = int(name.split(".")[1])
    if name.startswith(f"blk.{layer}.ffn_down"):
        return (Q.Q4_K, Q.Q6_K)[layer % 2]
    return (Q.Q4_0, Q.Q8_0, Q.Q4_1)[layer % 3]


@pytest.mark.slow
@pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")
def test_every_block_format_loses_under_one_percent_perplexity_to_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Computed on the blocks (int8 activations, the default bfloat16 KV cache) against the
    float32 path of the same file; per format, `turnstile bench quality` (docs/benchmarks.md)."""
    from turnstile.bench.quality_bench import measure

    with tempfile.TemporaryDirectory() as folder:  # its float32 copy: 0.5 GB, not kept
        monkeypatch.setenv("TURNSTILE_CACHE", folder)
        model = requantize(embedded_model_path(), Path(folder) / "mixed.gguf", _every_format)
        kinds = {t.name: t.kind for t in read_header(model).tensors}
        assert {kinds[f"blk.{i}.ffn_down.weight"] for i in (0, 1)} == {Q.Q4_K, Q.Q6_K}
        assert {kinds[f"blk.{i}.attn_q.weight"] for i in (0, 1, 2)} == {Q.Q4_0, Q.Q8_0, Q.Q4_1}
        report = measure(new_tokens=16, paths=("float32", "gguf"), model=model)
    ratio = report["gguf"].perplexity / report["float32"].perplexity
    assert 0.99 < ratio < 1.01, report
    assert report["gguf"].same_prefix > 0  # it generates text, not noise
