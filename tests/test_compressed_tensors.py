"""compressed-tensors checkpoints written by the library itself (`bench/compressed_checkpoint.py`:
llm-compressor's presets, rounded to nearest): served dequantized they generate transformers'
tokens and logprobs on the values the library decompresses; kept quantized (int weights, the cpu
backend's default) their matrices are those values and follow transformers within the int8
activations' rounding; act order's `weight_g_idx` is read as the library reads it; what is not
served is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_model_families import _checkpoint, generates_what_transformers_generates
from test_model_info import BASE_CONFIG
from test_quantized_checkpoints import kept_follows_transformers

from turnstile.kernels import cpu_native
from turnstile.shared.model_info import read_model_info

pytestmark = pytest.mark.slow  # loads transformers

# scheme: GROUP (a group's inputs, a block's side; unused by channel schemes)
VARIANTS = {"w4a16": 32, "w4a16-asym": 64, "w8a16": 0, "w8a8": 0, "fp8-dynamic": 0,
            "fp8-block": 32}  # fmt: skip
INT = [scheme for scheme in VARIANTS if not scheme.startswith("fp8")]


def _compressed(tmp_path: Path, scheme: str) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    """The checkpoint written in bfloat16 (as llm-compressor's are; bfloat16 scales are fp16s,
    so int weights stay quantized), transformers' float32 model on its values, and those."""
    from turnstile.bench.compressed_checkpoint import write

    model = _checkpoint("linear")
    for parameter in model.parameters():  # not `.to`: RoPE's buffer stays float32
        parameter.data = parameter.data.bfloat16().float()
    model.save_pretrained(tmp_path / "float")
    path = tmp_path / scheme
    values = write(tmp_path / "float", path, scheme, VARIANTS[scheme], dtype=torch.bfloat16)
    missing, _ = model.load_state_dict(values, strict=False)
    assert len(values) == 14 and not [name for name in values if name in missing]
    return path, model, values


@pytest.mark.parametrize("scheme", list(VARIANTS))
def test_dequantized_a_checkpoint_generates_what_transformers_generates(
    scheme: str, tmp_path: Path
) -> None:
    path, model, _ = _compressed(tmp_path, scheme)
    generates_what_transformers_generates(path, model, "linear", "cpu")


@pytest.mark.parametrize("scheme", INT)
def test_kept_quantized_the_matrices_are_the_librarys_values(scheme: str, tmp_path: Path) -> None:
    """Symmetric codes exactly; zero points' offsets (-zero * scale) rounded to fp16."""
    from turnstile.executor_svc.model.weights import load_weights
    from turnstile.kernels.quantized_weights import QuantizedWeight

    path, _, values = _compressed(tmp_path, scheme)
    info = read_model_info(path)
    bits = 4 if scheme.startswith("w4") else 8
    assert (info.quantization, info.weight_type, info.weight_bits) == ("compressed-tensors",
                                                                        "int", bits)  # fmt: skip
    weights = load_weights(path, info, quantized=True)
    for name, expected in values.items():
        weight = weights[name]
        assert isinstance(weight, QuantizedWeight) and weight.bits == bits
        bound = 2**-11 * weight.offset.float().abs().repeat_interleave(32, dim=1)
        exact = scheme != "w4a16-asym"
        assert ((weight.dequantize() - expected).abs() <= (0 if exact else bound)).all()


@pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")
@pytest.mark.parametrize("products", ["blocks", "auto"])
@pytest.mark.parametrize(("scheme", "moved"), [("w4a16", 0.9), ("w8a8", 0.01)])
def test_kept_quantized_a_checkpoint_follows_transformers(
    scheme: str, moved: float, products: str, tmp_path: Path
) -> None:
    path, model, _ = _compressed(tmp_path, scheme)
    kept_follows_transformers(path, model, products, moved)


@pytest.mark.parametrize("zeros", [False, True])
def test_act_orders_groups_are_read_as_written(zeros: bool) -> None:
    """Each input's group at random (`weight_g_idx`, as llm-compressor wrote act order before
    compressed-tensors 0.20 dropped it), codes and zero points packed by the library: each
    value is (code - its group's zero) * its group's scale."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from turnstile.kernels.packed_checkpoints import compressed

    generator = torch.Generator().manual_seed(0)
    out, inputs, group = 24, 96, 32
    codes = torch.randint(-8, 8, (out, inputs), generator=generator, dtype=torch.int8)
    scales = torch.rand(out, inputs // group, generator=generator) + 0.5
    zero = torch.randint(-8, 8, scales.shape, generator=generator, dtype=torch.int8)
    g_idx = (torch.arange(inputs) // group)[torch.randperm(inputs, generator=generator)]
    used = zero if zeros else torch.zeros_like(zero)
    expected = (codes.float() - used.float()[:, g_idx]) * scales[:, g_idx]
    packed_zero = pack_to_int32(zero, 4, packed_dim=0) if zeros else None
    ours = compressed(pack_to_int32(codes, 4), scales, packed_zero, g_idx, (out, inputs), 4, group)
    assert torch.equal(ours.values(), expected)
    assert ours.kept() is None  # act order's groups are not runs of blocks: dense


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
          "symmetric": True}}}}  # fmt: skip


def _with(weights: dict | None = None, **fields: Any) -> dict:
    group = CT["config_groups"]["group_0"]
    changed = {**group, "weights": {**group["weights"], **(weights or {})}}
    return {**CT, "config_groups": {"group_0": changed}, **fields}


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        (_with({"num_bits": 3}), "config_groups.group_0.weights.num_bits"),
        (_with({"type": "float"}), "config_groups.group_0.weights.type"),
        (_with({"strategy": "block"}), "config_groups.group_0.weights.strategy"),
        (_with({"dynamic": True}), "config_groups.group_0.weights.dynamic"),
        (_with({"group_size": None}), "config_groups.group_0.weights.group_size"),
        (_with(format="marlin-24"), "config_groups.group_0.format"),
        (_with(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config.format"),
        (_with(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (_with(transform_config={"config_groups": {}}), "transform_config"),
        (_with(quantization_status="frozen"), "quantization_status"),
        ({**CT, "config_groups": {**CT["config_groups"], "group_1": _with({"num_bits": 8})[
            "config_groups"]["group_0"]}}, "config_groups"),
        ({**_with(), "config_groups": {"group_0": {**_with()["config_groups"]["group_0"],
          "input_activations": {"num_bits": 4, "type": "int"}}}},
         "config_groups.group_0.input_activations.num_bits"),
    ],
)  # fmt: skip
def test_a_compressed_tensors_config_not_served_is_refused_by_field(
    quant: dict, field: str, tmp_path: Path
) -> None:
    from turnstile.shared.model_support import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | {"quantization_config": quant}))
    with pytest.raises(UnsupportedModel, match=f"config.json: quantization_config.{field} = "):
        read_model_info(tmp_path)


FP8_ROWS = {"type": "float", "num_bits": 8, "strategy": "channel"}


@pytest.mark.parametrize(("weights", "kept"), [({}, True), (FP8_ROWS, False)])
def test_auto_keeps_int_weights_quantized_and_dequantizes_fp8(
    weights: dict, kept: bool, tmp_path: Path
) -> None:
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.settings import build

    quant = _with(weights, format="float-quantized" if weights else "pack-quantized")
    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | {"quantization_config": quant}))
    runner = build(RunnerConfig, model=str(tmp_path), backend="cpu")
    assert create_backend(runner, read_model_info(tmp_path)).keeps_quantized() == kept
