"""`--kv-cache-dtype`: which dtype each backend keeps the cache in, the native kernels' stores
rounding as torch's, and attention reading an fp8 cache's values exactly. Attention over each
dtype against the reference: tests/test_native_kernels.py."""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import prompt_and_shared_prefix

from turnstile.executor_svc.backends import create_backend
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native, native_attention, reference
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.settings import build

FP8_NAMES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
amx = pytest.mark.skipif(not cpu_native.amx_tiles(), reason="this CPU has no AMX-BF16 tiles")


def test_the_kv_cache_dtype_is_bfloat16_on_quantized_weights_unless_asked_and_refused_by_name() -> (
    None
):
    """auto: the activations' dtype, bfloat16 where GGUF blocks stay quantized or bf16 weights
    take AMX-BF16 tiles; asked for, the dtype asked; on the cuda backend only the activations'
    dtype, refused at start else."""
    info = read_model_info(embedded_model_path())
    cpu = create_backend(build(RunnerConfig), info)
    assert cpu.kv_cache_dtype(torch.float32, quantized=True) == torch.bfloat16
    rows = create_backend(build(RunnerConfig, cpu_bf16_products="rows"), info)
    assert rows.kv_cache_dtype(torch.float32, quantized=False) == torch.float32
    exact = create_backend(build(RunnerConfig, dtype="float32"), info)
    assert exact.kv_cache_dtype(torch.float32, quantized=False) == torch.float32
    tiles = torch.bfloat16 if cpu_native.amx_tiles() else torch.float32
    assert cpu.kv_cache_dtype(torch.float32, quantized=False) == tiles
    asked = create_backend(build(RunnerConfig, kv_cache_dtype="float16"), info)
    assert asked.kv_cache_dtype(torch.float32, quantized=True) == torch.float16
    for name, dtype in FP8_NAMES.items():  # vLLM's names: fp8 is e4m3
        asked = create_backend(build(RunnerConfig, kv_cache_dtype=name), info)
        assert asked.kv_cache_dtype(torch.float32, quantized=True) == dtype
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8: the cuda"):
        create_backend(build(RunnerConfig, device="cuda", kv_cache_dtype="fp8"), info)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float32: the cuda .* \(bfloat16\)"):
        create_backend(build(RunnerConfig, device="cuda", kv_cache_dtype="float32"), info)


@pytest.mark.parametrize(("dtype", "code"), [(torch.bfloat16, 1), (torch.float16, 2)])
def test_a_16_bit_kv_cache_rounds_as_torch_does(dtype: torch.dtype, code: int) -> None:
    """decode_layer.c stores K and V in a 16-bit cache by `round_kv`; the torch layers by
    `.to(dtype)`: the same bits, so either route leaves the same cache."""
    lib = cpu_native.library()
    assert lib is not None
    # bfloat16's ties to even (down, then up), just below a tie, the largest float (to inf);
    # float16's overflow, underflow and subnormals.
    tie = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF], dtype=torch.int32)
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 7e4, 1e-7, -3e-5]
    x = torch.cat((tie.view(torch.float32), torch.tensor(special), torch.randn(1011) * 1e3))
    out = torch.empty(len(x), dtype=dtype)
    lib.round_kv(x.data_ptr(), out.data_ptr(), 0, len(x), code)
    expected = x.to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())  # a NaN's payload may differ
    number = ~expected.isnan()
    assert torch.equal(out[number].view(torch.int16), expected[number].view(torch.int16))


@pytest.mark.parametrize("dtype", FP8)
def test_an_fp8_kv_cache_rounds_as_the_torch_path_does(dtype: torch.dtype) -> None:
    """decode_layer.c's fp8 stores against the torch path's (`reference.write_kv`: clamped to
    the format's largest, then torch's conversion): ties to even among normals and subnormals,
    the largest, values beyond it and infinities (saturated), underflow to zero, every
    magnitude the format spans."""
    lib = cpu_native.library()
    assert lib is not None
    largest = torch.finfo(dtype).max
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[codes.isfinite()]
    # Each code, and the midpoints between neighbours (ties), a hair either side of them.
    ordered = codes.unique()
    middle = (ordered[1:] + ordered[:-1]) / 2
    near = torch.cat((middle, middle.nextafter(ordered[1:]), middle.nextafter(ordered[:-1])))
    special = [largest * 1.01, -largest * 1.2, float("inf"), -float("inf"), 1e-30, -0.0, 1e30]
    spread = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    spread = spread * torch.exp2(torch.randint(-20, 18, (4096,)).float())
    x = torch.cat((codes, near, torch.tensor(special), spread))
    x = torch.cat((x, x[: -len(x) % 8]))  # whole vectors
    cache = torch.empty(len(x), 1, 1, 1, dtype=dtype)
    reference.write_kv(x.view(-1, 1, 1), x.view(-1, 1, 1), cache, cache.clone(),
                       torch.arange(len(x)))  # fmt: skip
    out = torch.empty(len(x), dtype=dtype)
    lib.round_kv(x.data_ptr(), out.data_ptr(), 0, len(x), FP8.index(dtype) + 3)
    assert torch.equal(out.view(torch.uint8), cache.view(torch.uint8).flatten())


def _decode_rows(heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Enough decode rows of ragged lengths (4 a thread, and more) that their tiles take several
    KV heads; the first two share blocks."""
    rows = 4 * torch.get_num_threads() + 6
    generator = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(rows * 8, 16, kv_heads, dim, generator=generator) for _ in "kv")
    tables = torch.randperm(rows * 8, generator=generator).view(rows, 8)
    tables[1, :3] = tables[0, :3]
    lens = torch.randint(1, 128, (rows,), generator=generator)
    return k_cache, v_cache, tables, lens, torch.randn(rows, heads, dim, generator=generator)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=amx)])
# 96 dims: an odd count of 32-value slices a KV head
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 96)])
def test_attention_over_an_fp8_cache_reads_its_values_exactly(
    dtype: torch.dtype, tiles: bool, heads: int, kv_heads: int, dim: int
) -> None:
    """fp8 codes widen exactly: attention over an fp8 cache gets the bits it gets over the same
    values in bfloat16, on the tiles (which take bf16) and on the rows (which widen either to
    float32), for a prompt's rows beside a decode row, and for many decode rows. Values of every
    magnitude the formats hold, subnormals among them, and every finite code in some places."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes.view(dtype).float().isfinite()].repeat(8)
    prompt = prompt_and_shared_prefix(heads, kv_heads, dim, torch.float32)
    rows, generator = _decode_rows(heads, kv_heads, dim), torch.Generator().manual_seed(11)
    for keys, values, tables, lens, query in (prompt[:2] + prompt[3:], rows):
        exponents = torch.randint(-12, 6, keys.shape[:3], generator=generator)
        magnitude = torch.exp2(exponents.float())[..., None]
        k_cache, v_cache = (keys * magnitude).to(dtype), (values * magnitude).to(dtype)
        for cache in (k_cache, v_cache):
            places = torch.randperm(cache.numel(), generator=generator)[: len(codes)]
            cache.view(torch.uint8).view(-1)[places] = codes
        plan = reference.plan_decode(tables, lens, 16)
        for window in (0, 40):
            got = native_attention.paged_decode_attention(
                query, k_cache, v_cache, plan, 0.125, window, tiles=tiles
            )
            wide = native_attention.paged_decode_attention(
                query, k_cache.bfloat16(), v_cache.bfloat16(), plan, 0.125, window, tiles=tiles
            )
            assert torch.equal(got, wide)
