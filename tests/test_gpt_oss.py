"""gpt-oss against transformers: attention sinks, biases on q, k, v and o, sliding and full
layers in turn, yarn RoPE, and experts with biases and a clamped SwiGLU, their router's top-k
logits softmaxed; as transformers saves a random model, and with its experts in MXFP4 as OpenAI
ships them, which transformers itself dequantizes as the reference. Across tensor-parallel
ranks: `test_tensor_parallel.py`. The kernels' sinks:
`test_kernels.py` (Triton), `test_native_kernels.py` and `test_attention_tiles.py`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_model_families import SHAPE, _randomize, generates_what_transformers_generates

from turnstile.shared.model_info import read_model_info
from turnstile.shared.model_support import UnsupportedModel

pytestmark = pytest.mark.slow  # loads transformers


def _gpt_oss(path: Path, swiglu_limit: float = 2.0) -> Any:
    """A random two-layer gpt-oss (a sliding layer, then a full one), saved to `path`. Its
    sinks, biases and router made to count; SwiGLU clamped at 2, so that the clamp binds (a
    GGUF file's is llama.cpp's 7)."""
    import torch
    import transformers

    torch.manual_seed(0)
    rope = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64,
                rope_theta=1.5e5, beta_fast=32.0, beta_slow=1.0, truncate=False)  # fmt: skip
    config = transformers.GptOssConfig(
        **{**SHAPE, "intermediate_size": 64}, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=24, swiglu_limit=swiglu_limit, rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config).eval()
    _randomize(p for n, p in model.named_parameters() if n.endswith(("bias", "sinks")))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_gpt_oss_generates_what_transformers_generates(backend: str, tmp_path: Path) -> None:
    model = _gpt_oss(tmp_path)
    generates_what_transformers_generates(tmp_path, model, "gpt_oss", backend)


def _as_mxfp4(folder: Path, to: Path) -> None:
    """`folder`'s checkpoint with random MXFP4 experts, stored as OpenAI stores them: codes
    and scales outputs first, the rest as it was."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    draw = torch.Generator().manual_seed(1)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(name).shape
        shape = (experts, outputs, inputs // 32)
        weights[name + "_blocks"] = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8,
                                                  generator=draw)  # fmt: skip
        weights[name + "_scales"] = torch.randint(119, 125, shape, dtype=torch.uint8,
                                                  generator=draw)  # fmt: skip
    to.mkdir()
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (to / "config.json").write_text(json.dumps(config))


def test_mxfp4_experts_generate_what_transformers_generates_from_them(tmp_path: Path) -> None:
    import torch
    import transformers

    _gpt_oss(tmp_path / "dense")
    _as_mxfp4(tmp_path / "dense", tmp_path / "mxfp4")
    # transformers dequantizes MXFP4 on a CPU (exactly: e2m1 times a power of two)
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "mxfp4",
                                                           dtype=torch.float32)  # fmt: skip
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    generates_what_transformers_generates(tmp_path / "mxfp4", model.eval(), "gpt_oss", "cpu")


def test_mxfp4_values_are_transformers_dequantized_values() -> None:
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from turnstile.kernels.mxfp4_weights import mxfp4_values

    draw = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=draw)
    scales = torch.randint(100, 140, (3, 8, 4), dtype=torch.uint8, generator=draw)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # inputs first
    ours = mxfp4_values(blocks, scales)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours.transpose(1, 2).float(), theirs)


def test_mxfp4_is_refused_for_another_family(tmp_path: Path) -> None:
    _gpt_oss(tmp_path)
    info = read_model_info(tmp_path)
    assert info.attention_sinks and info.swiglu_limit == 2.0 and info.normalize_expert_weights
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llama", attention_bias=False,
                  quantization_config={"quant_method": "mxfp4"})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="quant_method"):
        read_model_info(tmp_path)


@pytest.mark.parametrize("experts", ["tiles", "blocks"])
def test_gpt_oss_in_the_fused_decode_layers_generates_what_its_layers_do(
    experts: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 experts on AMX tiles, or MXFP4 ones on their blocks, with gpt-oss's sinks, biases
    and sliding layer in decode_layer.c (one call a layer) against the model's layers."""
    from test_fused_decode_layers import INT8_ROUNDING, fused_generates_what_the_layers_do

    from turnstile.executor_svc.backends.native_decode import FUSED_EXPERTS
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.kernels import cpu_native
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.settings import build

    if cpu_native.library() is None or (experts == "tiles" and not cpu_native.amx_tiles()):
        pytest.skip("bf16 experts take the tiles on a CPU with AMX-BF16 only")
    _gpt_oss(tmp_path / "dense")
    path, settings, atol = tmp_path / "dense", {"dtype": "bfloat16"}, 1e-3
    if experts == "blocks":
        path, settings, atol = tmp_path / "mxfp4", {}, INT8_ROUNDING
        _as_mxfp4(tmp_path / "dense", path)

    def engine() -> OfflineEngine:
        config = build(RunnerConfig, model=str(path), num_blocks=64, max_num_seqs=4, **settings)
        return OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=64))

    # 40 tokens: past the sliding layer's window of 24
    for run in fused_generates_what_the_layers_do(monkeypatch, engine, 40, atol):
        assert all(isinstance(layer.experts, FUSED_EXPERTS) for layer in run.runner.model.layers)
