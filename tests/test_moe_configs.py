"""A mixture of experts' config.json read as transformers reads it where it leaves fields out:
its config classes' defaults (OpenAI's gpt-oss config has no `swiglu_alpha`, which would
otherwise read as 0 and halve every gate). Each family's config written without them, read by
Turnstile and by transformers' own class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnstile.shared.model_info import read_model_info
from turnstile.shared.model_support import MOE_DEFAULTS

pytestmark = pytest.mark.slow  # loads transformers

BASE = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5}  # fmt: skip


@pytest.mark.parametrize("family", list(MOE_DEFAULTS))
def test_left_out_fields_take_transformers_defaults(family: str, tmp_path: Path) -> None:
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(BASE | {"model_type": family}))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    info = read_model_info(tmp_path)
    for field, value in MOE_DEFAULTS[family].items():
        assert getattr(theirs, field) == value, field
    assert info.num_experts == (getattr(theirs, "num_local_experts", None) or theirs.num_experts)
    assert info.experts_per_token == theirs.num_experts_per_tok
    assert info.expert_intermediate_size == getattr(
        theirs, "moe_intermediate_size", theirs.intermediate_size
    )
    if family == "gpt_oss":
        assert (info.swiglu_alpha, info.swiglu_limit) == (1.702, 7.0)
    if family == "glm4_moe":
        assert info.expert_layers == tuple(range(theirs.first_k_dense_replace, 4))
        assert info.shared_expert_size == theirs.moe_intermediate_size * theirs.n_shared_experts
        assert info.normalize_expert_weights == theirs.norm_topk_prob
    if family == "qwen2_moe":
        assert info.shared_expert_size == theirs.shared_expert_intermediate_size
