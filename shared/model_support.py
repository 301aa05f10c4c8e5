"""What Turnstile runs exactly, and the refusal, at start and by name, of what it does not: a
model whose config asks for a feature the executor lacks would otherwise run and answer wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# config.json's model_type: the Llama-family decoders the executor computes.
FAMILIES = ("gemma2", "gemma3_text", "glm4_moe", "gpt_oss", "granite", "llama", "mistral",
            "mixtral", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
            "smollm3")  # fmt: skip
MOE_FAMILIES = ("glm4_moe", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
# Those with biases on q, k and v (Qwen2, GLM-4.5), and on o too (gpt-oss).
BIAS_FAMILIES = ("glm4_moe", "gpt_oss", "qwen2", "qwen2_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# Families whose attention normalizes each query and key head (RMSNorm) before RoPE.
QK_NORM_FAMILIES = ("gemma3_text", "qwen3", "qwen3_moe")
QWEN_FAMILIES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # a window: `use_sliding_window`
# Those whose window starts at layer `max_window_layers` (Qwen3-MoE's slides on every layer).
MAX_WINDOW_LAYERS_FAMILIES = ("qwen2", "qwen3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# config.json's `architectures`: a language model, a sequence classifier, a bare decoder.
HEADS = ("ForCausalLM", "ForSequenceClassification", "Model")
# general.architecture of the GGUF files read (Mistral's and Mixtral's are "llama"), each
# checked by a test that writes one against transformers (`tests/test_gguf_*.py`).
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "gpt-oss", "granite", "llama", "olmo2", "phi3", "qwen2",
                      "qwen3", "qwen3moe", "smollm3")  # fmt: skip
# Those whose q and k rows llama.cpp's converter interleaves (a whole head's, for its RoPE).
PERMUTED_ARCHITECTURES = ("llama", "granite", "smollm3")
# SmolLM3's layers without RoPE in a GGUF file: llama.cpp fixes the step (no key stores it),
# layer i skipping RoPE where (i + 1) % 4 == 0, as transformers' default no_rope_layers.
NO_ROPE_STEP = 4
SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX: routed as transformers routes
LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE types as transformers names them; the scaled ones are computed by transformers itself.
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")
# Those scaled from an original context length, which transformers requires.
NEEDS_ORIGINAL = ("llama3", "longrope", "yarn")
ORIGINAL = "original_max_position_embeddings"
# Not transformers': a GGUF file's RoPE as llama.cpp stores Llama 3.1's, each default frequency
# divided by its factor (`gguf_info.py`; a config.json asking for it is refused).
FREQUENCY_FACTORS = "frequency_factors"


class UnsupportedModel(ValueError):
    """A model, or a setting of it, that Turnstile does not run."""


def rope_type(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def activation(config: dict[str, Any]) -> str:
    return config.get("hidden_activation") or config.get("hidden_act") or "silu"


def rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The RoPE parameters of full-attention layers, and the sliding layers' where they have
    their own (Gemma 3: `rope_parameters` keyed by layer type). transformers 5 writes theta and
    scaling together as `rope_parameters`; older checkpoints have `rope_theta` and
    `rope_scaling` apart."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        return rope["full_attention"], rope.get("sliding_attention")
    rope = config.get("rope_scaling") or rope
    original = config.get("original_max_position_embeddings")
    if rope_type(rope) in NEEDS_ORIGINAL and original and ORIGINAL not in rope:
        rope = {**rope, ORIGINAL: original}  # Phi-3's older configs keep it beside rope_scaling
    if rope_type(rope) == "dynamic":  # scaled from max_position_embeddings, as transformers does
        rope = {**rope, ORIGINAL: config.get("max_position_embeddings", 4096)}
    return rope, None


def context_length(config: dict[str, Any]) -> int:
    """The longest sequence served: `max_position_embeddings`; with dynamic NTK RoPE, times
    its factor, the context it stretches to (as vLLM reads it)."""
    length = config.get("max_position_embeddings", 4096)
    rope, _ = rope_parameters(config)
    return int(length * rope["factor"]) if rope_type(rope) == "dynamic" else length


def family_features(config: dict[str, Any]) -> dict[str, Any]:
    """What sets a family's layers apart from Llama's, as `ModelInfo` fields."""
    family = config["model_type"]
    gemma = family in GEMMA_FAMILIES
    _, local = rope_parameters(config)
    # transformers' default for both Gemmas where the config leaves it out
    scale = config.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else 0.0
    embed_scale = config["hidden_size"] ** 0.5 if gemma else config.get("embedding_multiplier", 1)
    # OLMo 2 norms q and k each across all heads; GLM-4.5 per head where `use_qk_norm`
    per_head = family in QK_NORM_FAMILIES or config.get("use_qk_norm")
    qk_norm = "all" if family == "olmo2" else "head" if per_head else ""
    return {
        "hidden_act": activation(config),
        "qk_norm": qk_norm,
        "layer_windows": layer_windows(config),
        "attention_scale": config.get("attention_multiplier", scale),
        "norm_offset": 1.0 if gemma else 0.0,  # Gemma's norms scale by 1 + weight
        "norms": "sandwich" if gemma else "post" if family == "olmo2" else "pre",
        "embed_scale": float(embed_scale),
        "residual_multiplier": config.get("residual_multiplier", 1.0),
        "logits_scaling": config.get("logits_scaling", 1.0),
        "local_rope_theta": float(local["rope_theta"]) if local else 0.0,
        "final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0),
        "attn_logit_softcapping": float(config.get("attn_logit_softcapping") or 0.0),
        "nope_layers": nope_layers(config),
        "rotary_dim": rotary_dim(config),
        "attention_sinks": family == "gpt_oss",  # a learned logit a head, in each softmax's sum
        "chat_format": "harmony" if family == "gpt_oss" else "",
        **mixture_of_experts(config),
    }


def partial_rotary_factor(config: dict[str, Any]) -> float:
    rope, _ = rope_parameters(config)
    return float(
        (rope or {}).get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1
    )


def rotary_dim(config: dict[str, Any]) -> int:
    """The dims of a head RoPE rotates, where it rotates its first ones only (Phi-4-mini's 3/4,
    as transformers counts them); 0: all."""
    factor = partial_rotary_factor(config)
    if factor == 1:
        return 0
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(head_dim * factor)


def nope_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers[i]` is 1 where layer i rotates, 0 not."""
    return tuple(i for i, rotates in enumerate(config.get("no_rope_layers") or ()) if not rotates)


# What transformers' config classes take where a config.json leaves a field out (OpenAI's
# gpt-oss config has no `swiglu_alpha`), for the fields read below; `test_model_info.py` holds
# them to transformers.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                "swiglu_alpha": 1.702},
    "glm4_moe": {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                 "first_k_dense_replace": 1, "n_shared_experts": 1, "norm_topk_prob": True,
                 "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}  # fmt: skip


def mixture_of_experts(config: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's and gpt-oss's experts on every layer; Qwen3-MoE's on each
    `decoder_sparse_step`-th layer not in `mlp_only_layers`. Mixtral and gpt-oss (a softmax of
    the top-k logits) always scale the top-k weights to sum to 1, Qwen3-MoE where
    `norm_topk_prob`. gpt-oss's experts' SwiGLU is clamped at `swiglu_limit`. GLM-4.5's from
    `first_k_dense_replace` on, routed by DeepSeek-V3's grouped sigmoid, beside shared experts;
    Qwen2-MoE's as Qwen3-MoE's, beside a gated shared expert."""
    family = config["model_type"]
    if family not in MOE_FAMILIES:
        return {}
    config = MOE_DEFAULTS[family] | {k: v for k, v in config.items() if v is not None}
    count = config["num_hidden_layers"]
    if family == "glm4_moe":
        layers: tuple[int, ...] = tuple(range(config["first_k_dense_replace"], count))
    elif family not in ("qwen2_moe", "qwen3_moe"):
        layers = tuple(range(count))
    else:
        step, dense = config["decoder_sparse_step"], config["mlp_only_layers"]
        layers = tuple(i for i in range(count) if i not in dense and (i + 1) % step == 0)
    return {
        "num_experts": config.get("num_local_experts")
        or config.get("n_routed_experts")
        or config["num_experts"],
        "experts_per_token": config["num_experts_per_tok"],
        "expert_intermediate_size": config.get("moe_intermediate_size")
        or config["intermediate_size"],
        "normalize_expert_weights": family in ("mixtral", "gpt_oss")
        or bool(config["norm_topk_prob"]),
        "expert_layers": layers,
        "swiglu_limit": float(config.get("swiglu_limit", 0.0)),
        "swiglu_alpha": float(config.get("swiglu_alpha", 0.0)),
        **(_grouped_routing(config) if family == "glm4_moe" else {}),
        "shared_expert_size": _shared_expert_size(config),
    }


def _shared_expert_size(config: dict[str, Any]) -> int:
    """The inner dims of the experts every token goes through: GLM-4.5's `n_shared_experts` of
    `moe_intermediate_size` each, Qwen2-MoE's one (scaled by its own sigmoid gate); 0: none."""
    if config["model_type"] == "glm4_moe":
        return int(config["moe_intermediate_size"] * config["n_shared_experts"])
    return int(config.get("shared_expert_intermediate_size") or 0)


def _grouped_routing(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's (DeepSeek-V3's) routing."""
    return {
        "expert_groups": int(config["n_group"]),
        "kept_expert_groups": int(config["topk_group"]),
        "routed_scaling": float(config["routed_scaling_factor"]),
    }


def layer_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (a query sees itself and the window - 1 keys
    before it), 0 for full attention; () when no layer slides. As transformers reads it:
    `layer_types` where the config has them, else Qwen2's and Qwen3's window on the layers from
    `max_window_layers` on when `use_sliding_window`, else the window on every layer (Mistral's;
    Qwen3-MoE's when `use_sliding_window`)."""
    window = config.get("sliding_window")
    family, count = config.get("model_type"), config["num_hidden_layers"]
    if not window or (family in QWEN_FAMILIES and not config.get("use_sliding_window")):
        return ()
    if window >= config.get("max_position_embeddings", 4096):
        return ()  # wider than the context: never binds
    kinds = config.get("layer_types")
    if kinds is None and family in MAX_WINDOW_LAYERS_FAMILIES:
        first = config.get("max_window_layers", count)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(count)]
    windows = tuple(
        window if kind == "sliding_attention" else 0
        for kind in kinds or ["sliding_attention"] * count
    )
    return windows if any(windows) else ()


def check_hf_config(config: dict[str, Any], source: str) -> None:
    """Refuse a config.json asking for what the executor does not compute, naming the field."""
    family = config.get("model_type")
    if family not in FAMILIES:
        refuse(source, "model_type", family, f"supported: {', '.join(FAMILIES)}")
    for name in [a for a in config.get("architectures") or () if not str(a).endswith(HEADS)]:
        refuse(source, "architectures", name, f"supported: *{', *'.join(HEADS)}")
    if activation(config) not in ACTIVATIONS:
        refuse(source, "hidden_act", activation(config), f"supported: {', '.join(ACTIVATIONS)}")
    rope, local = rope_parameters(config)
    if rope_type(rope) not in ROPE_TYPES:
        refuse(source, "rope_scaling.rope_type", rope_type(rope),
                f"supported: {', '.join(ROPE_TYPES)}")  # fmt: skip
    if rope_type(rope) in NEEDS_ORIGINAL and ORIGINAL not in rope:
        refuse(source, f"rope_scaling.{ORIGINAL}", None, f"{rope_type(rope)} RoPE needs it")
    if local is not None and rope_type(local) != "default":
        refuse(source, "rope_parameters.sliding_attention.rope_type", rope_type(local),
                "sliding layers' RoPE: default only")  # fmt: skip
    if config.get("use_bidirectional_attention"):
        refuse(source, "use_bidirectional_attention", True, "not implemented")
    if rotary_dim(config) % 2:
        refuse(source, "partial_rotary_factor", partial_rotary_factor(config),
                "RoPE on an odd number of a head's dims")  # fmt: skip
    for kind in config.get("layer_types") or ():
        if kind not in LAYER_TYPES:
            refuse(source, "layer_types", kind, f"supported: {', '.join(LAYER_TYPES)}")
    if family not in BIAS_FAMILIES and config.get("attention_bias"):
        refuse(source, "attention_bias", True, "biases on q, k, v and o are not implemented")
    if config.get("mlp_bias"):
        refuse(source, "mlp_bias", True, "MLP biases are not implemented")


def check_gguf_fields(arch: str, field: Callable[[str], Any], source: str) -> None:
    """Refuse a GGUF file whose metadata (`field(key)`, None where absent) asks for what the
    executor does not compute."""
    if arch not in GGUF_ARCHITECTURES:
        refuse(source, "general.architecture", arch,
                f"supported: {', '.join(GGUF_ARCHITECTURES)}")  # fmt: skip
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "yarn"):
        refuse(source, f"{arch}.rope.scaling.type", scaling, "supported: none, linear, yarn")
    if scaling == "yarn" and field(f"{arch}.rope.scaling.original_context_length") is None:
        refuse(source, f"{arch}.rope.scaling.original_context_length", None, "yarn needs it")
    # llama.cpp's yarn settings beyond transformers' (DeepSeek's mscale among them)
    for key, default in (("yarn_log_multiplier", 0.0), ("yarn_ext_factor", -1.0),
                         ("yarn_attn_factor", 1.0)):  # fmt: skip
        value = field(f"{arch}.rope.scaling.{key}")
        if value not in (None, default):
            refuse(source, f"{arch}.rope.scaling.{key}", value, "not implemented")
    shared = field(f"{arch}.expert_shared_count")
    if shared:
        refuse(source, f"{arch}.expert_shared_count", shared, "shared experts: not implemented")
    gating = field(f"{arch}.expert_gating_func")
    if gating not in (None, SOFTMAX_GATING):
        refuse(source, f"{arch}.expert_gating_func", gating, "softmax routing only")
    rotated = field(f"{arch}.rope.dimension_count")
    if rotated is None:
        return
    heads = field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.embedding_length") // heads
    if rotated != head_dim and (arch in PERMUTED_ARCHITECTURES or rotated % 2):
        refuse(source, f"{arch}.rope.dimension_count", rotated,
                f"RoPE on part of a head ({head_dim} dims) of a {arch} file (whose whole heads "
                "are permuted), or on an odd number of dims: not implemented")  # fmt: skip


def refuse(source: str, field: str, value: object, why: str) -> None:
    raise UnsupportedModel(f"{source}: {field} = {value!r} is not supported ({why})")
