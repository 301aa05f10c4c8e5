"""Projections on AMX-INT8 tiles (kernels/native/int8_tiles.c, `--cpu-products tiles`): weights
requantized to int8 a feature, rows to 16 bits; the product equal to its torch reference bit for
bit, a row's bits independent of its batch, and the requantization kept only where it keeps
the weights."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf_models import random_blocks

from turnstile.executor_svc.backends import create_backend
from turnstile.executor_svc.backends.cpu import CpuNativeBackend
from turnstile.executor_svc.backends.packed_projection import TiledProjection
from turnstile.executor_svc.model.gguf_tensors import gguf_tensors
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native
from turnstile.kernels.gguf_blocks import from_gguf
from turnstile.kernels.int8_tiles import Int8Tiles, quantize_rows, reference_linear
from turnstile.kernels.quantized_weights import Q
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.settings import build

amx = pytest.mark.skipif(not cpu_native.amx_int8(), reason="this CPU has no AMX-INT8 tiles")


def test_weights_round_to_int8_a_feature_in_the_tiles_layout() -> None:
    values = torch.randn(37, 80) * torch.logspace(-2, 1, 37)[:, None]  # features apart in scale
    tiles = Int8Tiles.from_values(values)
    assert tiles.tiles.shape == (3, 2, 16, 16, 4)  # 37 features: 3 panels; 80 inputs: 2 quads
    scale = values.abs().amax(dim=1) / 127
    assert torch.equal(tiles.codes(), torch.round(values / scale[:, None]).to(torch.int8))
    assert torch.equal(tiles.scales[:37], scale) and not tiles.scales[37:].any()
    # B tiles [input quad][feature][4]: tile (panel 1, quad 1) row 3 holds inputs 76-79.
    assert torch.equal(tiles.tiles[1, 1, 3, 5], tiles.codes()[21, 76:80])
    assert not tiles.tiles[1, 1, 4:].any()  # inputs 80-127: zeros
    assert ((tiles.dequantize() - values).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="multiples of 16"):
        Int8Tiles.from_values(torch.randn(4, 40))


def test_rows_quantize_to_16_bits_with_a_scale_each() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3e-3, 2e-3, 1e-3, 0.0]])
    codes, scale = quantize_rows(x)
    assert codes[0].tolist() == [32767, -16384, 8192, 0]  # -16383.5 and 8191.75 rounded
    assert not codes[1].any() and scale[1] == 0
    assert codes[2, 0] == -32767 and (codes.abs() <= 32767).all()


@amx
@pytest.mark.parametrize(("features", "inputs"), [(100, 768), (48, 80), (576, 1536)])
def test_the_tiles_product_is_its_reference_bit_for_bit(features: int, inputs: int) -> None:
    """Partial panels and quads; a column of large values (an activation outlier) too."""
    generator = torch.Generator().manual_seed(features)
    tiles = Int8Tiles.from_values(torch.randn(features, inputs, generator=generator) * 0.05)
    bias = torch.randn(features, generator=generator)
    for rows in (1, 5, 16, 17, 33, 300):
        x = torch.randn(rows, inputs, generator=generator)
        x[:, 3] *= 50
        residual = torch.randn(rows, features, generator=generator)
        expected = reference_linear(x, tiles) + bias + residual
        assert torch.equal(TiledProjection(tiles, bias)(x, residual), expected)
        assert torch.equal(TiledProjection(tiles, None)(x), reference_linear(x, tiles))
    assert TiledProjection(tiles, bias)(torch.empty(0, inputs)).shape == (0, features)


@amx
def test_a_row_of_the_tiles_product_does_not_depend_on_its_batch() -> None:
    """1,103 rows run in several blocks of rows; each alone gives the bits it had there."""
    tiles = Int8Tiles.from_values(torch.randn(64, 576) * 0.05)
    x = torch.randn(1103, 576)
    together = TiledProjection(tiles, None)(x)
    for row in (0, 15, 16, 700, 1102):
        assert torch.equal(TiledProjection(tiles, None)(x[row : row + 1])[0], together[row])


@amx
def test_silu_in_gate_ups_finish_gives_the_bits_of_the_product_then_silu() -> None:
    """decode_layer's gate-up on the tiles takes silu(gate) * up in the product's finish (gate
    and up never leave it): the bits of the whole product, then its silu_and_multiply."""
    lib = cpu_native.library()
    assert lib is not None
    generator = torch.Generator().manual_seed(3)
    n, inputs = 48, 80  # three panels each; a partial quad
    tiles = Int8Tiles.from_values(torch.randn(2 * n, inputs, generator=generator) * 0.05)
    for rows in (0, 1, 17, 300):
        x = torch.randn(rows, inputs, generator=generator)
        x[:, 3] *= 50
        gate_up = TiledProjection(tiles, None)(x)
        expected, got = torch.full((rows, n), torch.nan), torch.full((rows, n), torch.nan)
        lib.silu_and_multiply(gate_up.data_ptr(), expected.data_ptr(), rows, n)
        weight = (tiles.tiles.data_ptr(), tiles.scales.data_ptr())
        failed = lib.gated_int8_tiles(x.data_ptr(), *weight, got.data_ptr(), rows, n, inputs)
        assert failed == 0 and torch.equal(got, expected)
        gate, up = gate_up.split(n, dim=1)
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)


def test_int8_keeps_trained_weights_not_blocks_of_scales_far_apart() -> None:
    """The embedded model's Q4_1 layer loses ~1% a block; random K-quant blocks, whose scales
    along a feature span orders of magnitude, lose most of their small blocks: kept as blocks."""
    _, tensors = gguf_tensors(embedded_model_path())
    layer = next(t for t in tensors if t.name == "blk.0.ffn_down.weight")
    trained = from_gguf(np.array(layer.data), layer.tensor_type).dequantize()
    assert Int8Tiles.from_values(trained).faithful(trained)
    for kind in (Q.Q4_K, Q.Q6_K):
        values = from_gguf(random_blocks(kind, 64, 512), kind).dequantize()
        assert not Int8Tiles.from_values(values).faithful(values)


@pytest.mark.parametrize(
    ("option", "off", "attribute", "available"),
    [
        ("cpu_attention", "rows", "attention_tiles", cpu_native.amx_tiles),
        ("cpu_products", "blocks", "product_tiles", cpu_native.amx_int8),
    ],
)
def test_the_cpu_backend_takes_amx_tiles_as_asked(
    option: str, off: str, attribute: str, available: Callable[[], bool]
) -> None:
    """`--cpu-attention`, `--cpu-products`: auto takes the tiles where the CPU has them, the
    other choice never does, and tiles where the CPU lacks them is refused at start by name."""
    info = read_model_info(embedded_model_path())

    def tiles(choice: str) -> bool:
        backend = create_backend(build(RunnerConfig, **{option: choice}), info)
        assert isinstance(backend, CpuNativeBackend)
        return getattr(backend, attribute)

    assert tiles("auto") == available()
    assert not tiles(off)
    if available():
        assert tiles("tiles")
    else:
        with pytest.raises(ValueError, match=f"--{option.replace('_', '-')} tiles"):
            tiles("tiles")
