"""RMSNorm on the CPU (`kernels/native/rms_norm.c`), which the fused layers and the cpu
backend's layers both run: torch's numbers, a row's bits whatever rows surround it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnstile.kernels import cpu_native

# 576 and 2,880: the embedded model's and gpt-oss's hidden sizes; 100 and 7: whole vectors of
# eight and a tail, and a tail alone.
WIDTHS = [7, 100, 576, 2880]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_the_native_norm_is_torchs_to_rounding(width: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(width + rows)
    x, weight = torch.randn(rows, width, generator=generator) * 3, torch.randn(width)
    expected = F.rms_norm(x.double(), (width,), weight.double(), 1e-6)
    torch.testing.assert_close(cpu_native.rms_norm(x, weight, 1e-6).double(), expected,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    x, weight = torch.randn(64, 576), torch.randn(576)
    together = cpu_native.rms_norm(x, weight, 1e-5)
    for row in (0, 7, 63):
        assert torch.equal(cpu_native.rms_norm(x[row : row + 1], weight, 1e-5)[0], together[row])


def test_the_cpu_backend_norms_float32_rows_natively() -> None:
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.settings import build

    backend = create_backend(build(RunnerConfig), read_model_info(embedded_model_path()))
    x, weight = torch.randn(40, 576), torch.randn(576)
    assert torch.equal(backend.rms_norm(x, weight, 1e-5), cpu_native.rms_norm(x, weight, 1e-5))
    halves = backend.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5)  # torch's, in bf16
    assert torch.equal(halves, F.rms_norm(x.bfloat16(), (576,), weight.bfloat16(), 1e-5))
