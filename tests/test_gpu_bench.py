"""`turnstile bench gpu` where no GPU is: a clear refusal; and its roofline's byte count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from turnstile.bench import gpu_bench
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


@pytest.mark.slow
def test_the_commands_roofline_step_runs_where_no_gpu_is(tmp_path: Path) -> None:
    """No GPU here, so it runs on the CPU (its backend, not CUDA's), on a tiny random Llama the
    command's own writer makes: its code is known to work before a GPU session spends its
    minutes on it."""
    shape = gpu_bench.LARGE_LLAMA | {"hidden_size": 256, "intermediate_size": 512,
                                     "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
    model = gpu_bench.write_random_llama(tmp_path, shape, "cpu")
    report = gpu_bench.decode_roofline(model, [1, 2], 32, 4, 1e11, 4e11, "cpu")
    assert [row["rows"] for row in report] == [1, 2]
    for row in report:
        assert row["step_ms"] > 0
        assert row["of_measured_roofline"] == pytest.approx(4 * row["of_nominal_roofline"])


def test_a_failing_section_is_reported_and_the_next_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU's first run must not lose every figure to one failure. No GPU here: the device's
    name, bandwidth and cache are faked, the sections' loop is real."""
    monkeypatch.setattr(gpu_bench, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu_bench, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(gpu_bench.torch.cuda, "get_device_name", lambda _: "fake")
    monkeypatch.setattr(gpu_bench.torch.cuda, "empty_cache", lambda: None)

    def broken(measured: gpu_bench.Measured) -> object:
        raise RuntimeError("a kernel failed")

    sections = {"broken": broken, "fine": lambda m: {"steps": m.steps, "nominal": m.nominal}}
    monkeypatch.setattr(gpu_bench, "SECTIONS", sections)
    reports: list[dict[str, object]] = []
    report = gpu_bench.run(None, 4.8, 8, 5, lambda r: reports.append(dict(r)))
    assert "RuntimeError: a kernel failed" in report["broken"]["error"][-1]  # type: ignore[index]
    assert report["fine"] == {"steps": 5, "nominal": 4.8e12}
    assert ["broken" in r and "fine" not in r for r in reports] == [True, False]
    with pytest.raises(SystemExit, match="no section nope"):
        gpu_bench.run(["fine", "nope"], 4.8, 8, 5, reports.append)
