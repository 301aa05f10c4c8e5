"""`--kv-cache-dtype`: which dtype each backend keeps the cache in, and the native kernels'
16-bit stores rounding as torch's. Attention over each dtype: tests/test_native_kernels.py."""

from __future__ import annotations

import pytest
import torch

from turnstile.executor_svc.backends import create_backend
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.settings import build


def test_the_kv_cache_dtype_is_bfloat16_on_quantized_weights_unless_asked_and_refused_by_name() -> (
    None
):
    """auto: the activations' dtype, bfloat16 where GGUF blocks stay quantized; asked for, the
    dtype asked; on the cuda backend only the activations' dtype, refused at start else."""
    info = read_model_info(embedded_model_path())
    cpu = create_backend(build(RunnerConfig), info)
    assert cpu.kv_cache_dtype(torch.float32, quantized=True) == torch.bfloat16
    assert cpu.kv_cache_dtype(torch.float32, quantized=False) == torch.float32
    asked = create_backend(build(RunnerConfig, kv_cache_dtype="float16"), info)
    assert asked.kv_cache_dtype(torch.float32, quantized=True) == torch.float16
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float32: the cuda .* \(bfloat16\)"):
        create_backend(build(RunnerConfig, device="cuda", kv_cache_dtype="float32"), info)


@pytest.mark.parametrize(("dtype", "code"), [(torch.bfloat16, 1), (torch.float16, 2)])
def test_a_16_bit_kv_cache_rounds_as_torch_does(dtype: torch.dtype, code: int) -> None:
    """decode_layer.c stores K and V in a 16-bit cache by `round_to_half`; the torch layers by
    `.to(dtype)`: the same bits, so either route leaves the same cache."""
    lib = cpu_native.library()
    assert lib is not None
    # bfloat16's ties to even (down, then up), just below a tie, the largest float (to inf);
    # float16's overflow, underflow and subnormals.
    tie = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF], dtype=torch.int32)
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 7e4, 1e-7, -3e-5]
    x = torch.cat((tie.view(torch.float32), torch.tensor(special), torch.randn(1011) * 1e3))
    out = torch.empty(len(x), dtype=dtype)
    lib.round_to_half(x.data_ptr(), out.data_ptr(), len(x), code)
    expected = x.to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())  # a NaN's payload may differ
    number = ~expected.isnan()
    assert torch.equal(out[number].view(torch.int16), expected[number].view(torch.int16))
