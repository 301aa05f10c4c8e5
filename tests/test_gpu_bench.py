"""`turnstile bench gpu` where no GPU is: a clear refusal; and its roofline's byte count."""

from __future__ import annotations

import subprocess
import sys

import pytest

from turnstile.bench.gpu_bench import step_bytes
from turnstile.executor_svc.model.weights import load_weights
from turnstile.shared.model_info import embedded_model_path, read_model_info


@pytest.mark.slow
def test_without_a_gpu_the_command_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "bench", "gpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "needs a CUDA GPU" in done.stderr


def test_a_decode_step_reads_every_weight_but_the_norms_once_and_the_rows_kv() -> None:
    path = embedded_model_path()
    info = read_model_info(path)
    tensors = load_weights(path, info)  # tied: the embedding once, no lm_head
    assert "lm_head.weight" not in tensors
    weights = sum(t.numel() for name, t in tensors.items() if "norm" not in name)
    kv_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim
    assert step_bytes(info, 2, []) == 2 * weights
    assert step_bytes(info, 2, [10, 30]) == 2 * (weights + 40 * kv_per_token)
