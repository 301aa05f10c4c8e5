"""GPTQ, AWQ and fp8 checkpoints: a random Llama's projections written in AutoGPTQ's, AutoAWQ's
and vLLM's fp8 layouts (`bench/quantized_checkpoint.py`, rounded to nearest), served dequantized
they generate transformers' tokens and logprobs on the same values; kept quantized (GPTQ and AWQ
on the cpu backend's default) their matrices are the checkpoint's values and follow transformers
within the int8 activations' rounding; and what vLLM does not serve, or Turnstile does not
compute, is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_model_families import PROMPTS, _checkpoint, generates_what_transformers_generates
from test_model_info import BASE_CONFIG

from turnstile.kernels import cpu_native
from turnstile.shared.model_info import read_model_info

pytestmark = pytest.mark.slow  # loads transformers

# (method, bits, group, act order): 4 and 8 bits, groups of one block, two, a whole row, and
# GPTQ's act order (each input's group at random: computed dequantized).
VARIANTS = {
    "gptq4": ("gptq", 4, 32, False),
    "gptq8": ("gptq", 8, 64, False),
    "gptq4-act-order": ("gptq", 4, 32, True),
    "awq4": ("awq", 4, 32, False),
    "awq4-row": ("awq", 4, -1, False),
    "fp8": ("fp8", 8, -1, False),  # a scale a tensor
    "fp8-blocks": ("fp8", 8, 48, False),  # a scale a block of 48 x 48, the last ones partial
}
KEPT = [name for name, (method, *_) in VARIANTS.items() if method != "fp8"]


def _quantized(tmp_path: Path, variant: str) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    """The checkpoint written, transformers' model on its values, and those values."""
    from turnstile.bench.quantized_checkpoint import write

    model = _checkpoint("linear")
    model.save_pretrained(tmp_path / "float")
    values = write(tmp_path / "float", tmp_path / variant, *VARIANTS[variant])
    missing, _ = model.load_state_dict(values, strict=False)
    assert not [name for name in values if name in missing]
    return tmp_path / variant, model, values


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dequantized_a_checkpoint_generates_what_transformers_generates(
    variant: str, tmp_path: Path
) -> None:
    """float32: the same greedy tokens, and logprobs to 1e-4, through chunks and preemption."""
    path, model, _ = _quantized(tmp_path, variant)
    generates_what_transformers_generates(path, model, "linear", "cpu")


def test_the_torch_backend_dequantizes_a_checkpoint_alike(tmp_path: Path) -> None:
    path, model, _ = _quantized(tmp_path, "awq4")
    generates_what_transformers_generates(path, model, "linear", "torch")


@pytest.mark.parametrize("variant", KEPT)
def test_kept_quantized_the_matrices_are_the_checkpoints_values(
    variant: str, tmp_path: Path
) -> None:
    """GPTQ's exactly; AWQ's offsets (-zero * scale) rounded to fp16, at most 2**-11 of each;
    act order's groups are not runs of blocks: dense, exactly."""
    from turnstile.executor_svc.model.weights import load_weights
    from turnstile.kernels.quantized_weights import QuantizedWeight

    path, _, values = _quantized(tmp_path, variant)
    info = read_model_info(path)
    method, bits, group, act_order = VARIANTS[variant]
    assert (info.quantization, info.weight_bits, info.weight_group) == (method, bits, max(group, 0))
    weights = load_weights(path, info, quantized=True)
    assert len(values) == 14  # 7 projections a layer
    for name, expected in values.items():
        weight = weights[name]
        assert isinstance(weight, QuantizedWeight) != act_order
        if act_order:
            assert torch.equal(weight, expected)
            continue
        assert weight.bits == bits and weight.group == 32
        if method == "gptq":
            assert torch.equal(weight.dequantize(), expected)
        else:
            bound = 2**-11 * weight.offset.float().abs().repeat_interleave(32, dim=1)
            assert ((weight.dequantize() - expected).abs() <= bound).all()


@pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")
@pytest.mark.parametrize("products", ["blocks", "auto"])
@pytest.mark.parametrize("variant", ["gptq4", "awq4"])
def test_kept_quantized_a_checkpoint_follows_transformers(
    variant: str, products: str, tmp_path: Path
) -> None:
    path, model, _ = _quantized(tmp_path, variant)
    kept_follows_transformers(path, model, products)


def kept_follows_transformers(path: Path, model: Any, products: str, moved: float = 0.9) -> None:
    """On the cpu backend's default (weights kept quantized, activations rounded to int8 per
    block of 32, or to 16 bits a row on AMX tiles), each prompt with transformers' greedy
    continuation, read back as prompt logprobs: within 0.1 of transformers' on the checkpoint's
    values on average (at most 1.0), where the weights' rounding itself moves them `moved` or
    more from the float model's (0.9 for 4 bits)."""
    from conftest import fixed_length_requests

    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    if products == "auto" and not cpu_native.amx_int8():
        pytest.skip("auto is blocks on this CPU, without AMX-INT8")
    with torch.inference_mode():
        full = [model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0]
                for ids in PROMPTS]  # fmt: skip
    engine = OfflineEngine(build(RunnerConfig, model=str(path), cpu_products=products))
    assert engine.runner.quantized
    prompts = [ids.tolist() for ids in full]
    results = engine.generate(fixed_length_requests(prompts, SamplingParams(prompt_logprobs=0), 1))
    ours = torch.cat([torch.tensor(result.prompt_logprobs) for result in results])
    quantized = _teacher_forced(model, full)
    unquantized = _teacher_forced(_checkpoint("linear"), full)
    assert ours.shape == quantized.shape == (sum(len(ids) - 1 for ids in full),)
    assert (ours - quantized).abs().mean() < 0.1
    assert (quantized - unquantized).abs().mean() > moved
    assert (ours - quantized).abs().max() < 1.0


def _teacher_forced(model: Any, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence's tokens' logprobs after the first, one after another."""
    with torch.inference_mode():
        logprobs = [model(ids[None]).logits[0, :-1].float().log_softmax(-1) for ids in sequences]
    return torch.cat([lp[torch.arange(len(ids) - 1), ids[1:]]
                      for lp, ids in zip(logprobs, sequences, strict=True)])  # fmt: skip


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}  # fmt: skip


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "modelopt"}, "quant_method"),
        ({**GPTQ, "bits": 3}, "bits"),
        ({**GPTQ, "sym": False}, "sym"),
        ({**GPTQ, "checkpoint_format": "gptq_v2"}, "checkpoint_format"),
        ({**GPTQ, "dynamic": {r"+:.*\.1\..*": {"bits": 8}}}, "dynamic"),
        ({**GPTQ, "group_size": 0}, "group_size"),
        ({**AWQ, "bits": 8}, "bits"),
        ({**AWQ, "zero_point": False}, "zero_point"),
        ({**AWQ, "version": "gemv"}, "version"),
        ({**FP8, "fmt": "e5m2"}, "fmt"),
        ({**FP8, "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_a_quantization_config_not_served_is_refused_by_field(
    quant: dict, field: str, tmp_path: Path
) -> None:
    from turnstile.shared.model_support import UnsupportedModel

    config = BASE_CONFIG | {"quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=f"config.json: quantization_config.{field} = "):
        read_model_info(tmp_path)


@pytest.mark.parametrize(
    ("quant", "flags", "refusal"),
    [
        (GPTQ, dict(quantization="awq"), "--quantization awq needs a AWQ checkpoint; .* GPTQ"),
        (None, dict(quantization="gptq"), "config.json names no quantization"),
        (GPTQ, dict(quantization="gguf"), "--quantization gguf needs a GGUF file"),
        (AWQ, dict(quantization="awq", backend="torch"), "runs on the cpu backend, not the torch"),
        (AWQ, dict(quantization="awq", tensor_parallel_size=2), "awq runs on one rank"),
    ],
)
def test_a_quantization_flag_the_checkpoint_does_not_fit_is_refused(
    quant: dict | None, flags: dict, refusal: str, tmp_path: Path
) -> None:
    """As vLLM refuses a `--quantization` its checkpoint's config does not name; before any
    weight is read."""
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.settings import build

    config = BASE_CONFIG | ({"quantization_config": quant} if quant else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = build(RunnerConfig, model=str(tmp_path), **flags)
    backend = create_backend(runner, read_model_info(tmp_path))
    with pytest.raises(ValueError, match=refusal):
        backend.keeps_quantized()


@pytest.mark.parametrize(("quant", "flags", "kept"), [(AWQ, {}, True),
                                                      (AWQ, {"dtype": "float32"}, False),
                                                      (AWQ, {"quantization": "none"}, False),
                                                      (AWQ, {"tensor_parallel_size": 2}, False),
                                                      (FP8, {}, False)])  # fmt: skip
def test_auto_keeps_a_checkpoint_quantized_only_where_the_cpu_backend_computes_on_it(
    quant: dict, flags: dict, kept: bool, tmp_path: Path
) -> None:
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.settings import build

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | {"quantization_config": quant}))
    runner = build(RunnerConfig, model=str(tmp_path), backend="cpu", **flags)
    assert create_backend(runner, read_model_info(tmp_path)).keeps_quantized() == kept


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_lora_adapter_runs_on_a_quantized_base(dtype: str, tmp_path: Path) -> None:
    """PEFT's adapter on transformers' model of the checkpoint's values: dequantized in float32
    the same greedy tokens; kept quantized (the fused layers add the adapter's pairs to the
    quantized products) its continuations' logprobs within 0.1 on average, where the adapter
    moves them more than 1.0."""
    import peft
    from conftest import fixed_length_requests
    from msgspec.structs import replace

    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.lora import adapters
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    path, model, _ = _quantized(tmp_path, "gptq4")
    torch.manual_seed(1)
    modules = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    config = peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=modules)
    adapted = peft.get_peft_model(model, config).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    with torch.inference_mode(), adapted.disable_adapter():
        unadapted = [adapted.generate(input_ids=torch.tensor([ids]), max_new_tokens=16,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0]
                     for ids in PROMPTS]  # fmt: skip
    with torch.inference_mode():
        full = [adapted.generate(input_ids=torch.tensor([ids]), max_new_tokens=16,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0]
                for ids in PROMPTS]  # fmt: skip
    assert all(not torch.equal(a, b) for a, b in zip(full, unadapted, strict=True))
    runner = build(RunnerConfig, model=str(path), dtype=dtype, enable_lora=True,
                   lora_modules=[f"fruity={tmp_path / 'adapter'}"])  # fmt: skip
    engine = OfflineEngine(runner)
    assert engine.runner.quantized == (dtype == "auto")
    ref = adapters(runner.lora, engine.runner.info)[0].ref
    if dtype == "float32":
        requests = fixed_length_requests(PROMPTS, SamplingParams(), 16)
        results = engine.generate([replace(r, lora=ref) for r in requests])
        continuations = [ids[len(p) :].tolist() for ids, p in zip(full, PROMPTS, strict=True)]
        assert [r.token_ids for r in results] == continuations
        return
    prompts = [ids.tolist() for ids in full]
    requests = fixed_length_requests(prompts, SamplingParams(prompt_logprobs=0), 1)
    results = engine.generate([replace(r, lora=ref) for r in requests])
    ours = torch.cat([torch.tensor(result.prompt_logprobs) for result in results])
    with adapted.disable_adapter():
        base = _teacher_forced(adapted, full)
    gap = (ours - _teacher_forced(adapted, full)).abs().mean()
    assert gap < 0.1 < 1.0 < (ours - base).abs().mean()  # the adapter moves them 1.9 here
