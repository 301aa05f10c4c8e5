"""Experts beside shared ones every token goes through, against transformers. GLM-4.5's layer
(`glm4_moe`): a dense first layer, then experts routed as DeepSeek-V3 routes them (each expert's
sigmoid score, a correction bias added only to choose, the top-k chosen within the best groups,
the weights normalized and scaled) beside a shared expert; q, k and v biases, q and k normed per
head, RoPE on half of each head. Qwen2-MoE's: a softmax router, a shared expert scaled by its
own sigmoid gate, a dense second layer. Random weights, written by transformers, routers, gates
and biases made to count; across tensor-parallel ranks: `test_tensor_parallel.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_model_families import SHAPE, _randomize, generates_what_transformers_generates

pytestmark = pytest.mark.slow  # loads transformers


def _glm4_moe(path: Path) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        **SHAPE, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        pad_token_id=0,
    )  # fmt: skip
    model = transformers.Glm4MoeForCausalLM(config).eval()
    counting = ("bias", "gate.weight", "e_score_correction_bias", "q_norm.weight", "k_norm.weight")
    _randomize(p for n, p in model.named_parameters() if n.endswith(counting))
    for name, buffer in model.named_buffers():  # the correction bias is a buffer
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def _qwen2_moe(path: Path) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1],
        pad_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    _randomize(p for n, p in model.named_parameters() if n.endswith(("bias", "gate.weight")))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", ["glm4_moe", "qwen2_moe"])
def test_shared_experts_generate_what_transformers_generates(
    family: str, backend: str, tmp_path: Path
) -> None:
    model = (_glm4_moe if family == "glm4_moe" else _qwen2_moe)(tmp_path)
    generates_what_transformers_generates(tmp_path, model, family, backend)


@pytest.mark.parametrize("family", ["glm4_moe", "qwen2_moe"])
def test_shared_experts_in_the_fused_decode_layers_generate_what_the_layers_do(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 experts on AMX tiles, GLM-4.5's grouped sigmoid router or Qwen2-MoE's softmax,
    and the shared experts (Qwen2-MoE's gated) in decode_layer.c against the model's layers."""
    from test_fused_decode_layers import fused_generates_what_the_layers_do

    from turnstile.executor_svc.backends.tiled_experts import TiledExperts
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.kernels import cpu_native
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.settings import build

    if cpu_native.library() is None or not cpu_native.amx_tiles():
        pytest.skip("bf16 experts take the tiles on a CPU with AMX-BF16 only")
    (_glm4_moe if family == "glm4_moe" else _qwen2_moe)(tmp_path)

    def engine() -> OfflineEngine:
        config = build(RunnerConfig, model=str(tmp_path), dtype="bfloat16", num_blocks=64,
                       max_num_seqs=4)  # fmt: skip
        return OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=64))

    for run in fused_generates_what_the_layers_do(monkeypatch, engine):
        experts = [layer.experts for layer in run.runner.model.layers if layer.experts]
        assert experts and all(isinstance(each, TiledExperts) for each in experts)
        assert all(layer.gate_up is not None for layer in run.runner.model.layers)
