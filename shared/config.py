"""The settings every service shares, and the scheduler's own (the offline engine runs it too)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from turnstile.shared.model_info import ModelInfo, read_model_info, resolve_model_path
from turnstile.shared.settings import nested, setting
from turnstile.shared.speculative import Speculation, parse_speculation

Policy = Literal["fcfs", "priority"]
# The baseline continuous batching is measured against (docs/benchmarks.md): "padded" keeps a
# finished row computing until its batch ends, as HF `generate` does; "compact" lets it leave.
StaticBatching = Literal["padded", "compact"]


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """The model, and the shape every service of one engine agrees on"""

    model: str = setting(
        "embedded",
        "GGUF file, Hugging Face safetensors folder, or a Hugging Face id (org/name) found in the "
        "local Hugging Face cache; embedded: SmolLM2-135M-Instruct",
    )
    revision: str | None = setting(
        None, "with a Hugging Face id: the branch, tag or commit in the cache (default: main)"
    )
    tokenizer: str | None = setting(
        None,
        "a folder, or a Hugging Face id in the local cache, whose tokenizer and chat template "
        "serve in place of the model's: a GGUF file's base model's, as vLLM's docs advise",
    )
    hf_overrides: dict[str, Any] | None = setting(
        None,
        "config.json's fields replaced, as JSON (vLLM's flag), e.g. Qwen3-Reranker's "
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}',
    )
    runner: Literal["auto", "generate", "pooling"] = setting(
        "auto",
        "generate: completions, chats, the Responses and Messages APIs only; pooling: "
        "embeddings, scores, reranking and classification only; auto: both (a sequence "
        "classifier: pooling) (vLLM's flag)",
    )
    convert: Literal["auto", "none", "embed", "classify"] = setting(
        "auto",
        "embed: embeddings of the last token's hidden state, a classifier's head aside; "
        "classify: a sequence classifier with the checkpoint's score head; auto, none: as "
        "config.json says (vLLM's flag)",
    )
    max_model_len: int | None = setting(None, "context length to serve (none: the model's)")
    block_size: int = setting(16, "tokens per KV-cache block")
    max_num_seqs: int = setting(128, "sequences one step may run")
    tensor_parallel_size: int = setting(
        1, "executor ranks that split each layer of the model between them (torch.distributed)"
    )
    max_logprobs: int = setting(
        20,
        "the most top logprobs a request may ask for a token or a prompt token; -1: the "
        "vocabulary's size (vLLM's flag)",
    )
    trust_remote_code: bool = setting(
        False,
        "accepted as vLLM's command lines pass it: no model's own code ever runs here (a model "
        "that needs it is refused by its model_type)",
    )

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.tensor_parallel_size <= 0:
            raise ValueError(
                "--block-size, --max-num-seqs and --tensor-parallel-size must be positive"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("--max-model-len must be positive")
        if self.max_logprobs < -1:
            raise ValueError("--max-logprobs must be -1 (the vocabulary) or at least 0")

    @property
    def model_path(self) -> Path:
        return resolve_model_path(self.model, self.revision)

    def model_info(self) -> ModelInfo:
        """The model's shape and settings, with --hf-overrides, --convert and --runner."""
        overrides = self.hf_overrides or {}
        if self.convert == "classify":  # whatever its architecture's name, its `score` head
            overrides = {"architectures": ["ForSequenceClassification"], **overrides}
        info = read_model_info(self.model_path, overrides)
        if self.convert == "embed":
            info = replace(info, labels=(), classifier_tokens=())
        if (info.labels or info.encoder_only) and self.runner == "generate":
            kind = "a sequence classifier" if info.labels else "an encoder"
            raise ValueError(f"--runner generate: {self.model} is {kind}, which generates "
                             "nothing (--runner pooling or auto serve it)")  # fmt: skip
        return replace(info, runner=self.runner)

    @property
    def tokenizer_path(self) -> Path:
        """Where the tokenizer comes from: --tokenizer's folder, else the model."""
        return self.model_path if self.tokenizer is None else resolve_model_path(self.tokenizer)


@dataclass(slots=True, frozen=True)
class AddressConfig:
    """Where the services meet (ZeroMQ)"""

    scheduler_address: str | None = setting(
        None,
        "gateways reach the scheduler here; tcp:// across hosts (none: ipc:// in a private "
        "0700 directory: serve's own, else $TURNSTILE_RUN_DIR, $XDG_RUNTIME_DIR/turnstile or "
        "/tmp/turnstile-UID)",
    )
    executors_address: str | None = setting(
        None, "executors reach the scheduler here (none: as --scheduler-address)"
    )


DEFAULT_BATCHED_TOKENS = 2048  # a step's tokens where --max-num-batched-tokens is not given


def token_budget(given: int | None, context: int, whole_prompts: bool) -> int:
    """A step's tokens: --max-num-batched-tokens, else the default, or where prompts run whole
    (an encoder's) its context if that is longer, as vLLM raises it: else a long prompt would
    never fit a step."""
    if given is not None:
        return given
    return max(DEFAULT_BATCHED_TOKENS, context) if whole_prompts else DEFAULT_BATCHED_TOKENS


def whole_prompts_refusal(budget: int, context: int) -> str:
    return (
        f"--max-num-batched-tokens {budget} is less than the context ({context}): an encoder "
        "computes each prompt in one step (raise it, or lower --max-model-len)"
    )


@dataclass(slots=True, frozen=True)
class SchedulingConfig:
    """How the scheduler fills each step"""

    max_num_batched_tokens: int | None = setting(
        None,
        f"tokens one step may compute (default {DEFAULT_BATCHED_TOKENS}; an encoder's: its "
        "context where that is longer, as vLLM's)",
    )
    policy: Policy = setting(
        "fcfs", "which waiting request starts first", alias="scheduling-policy"
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(
        True,
        "prompts computed in chunks that fit --max-num-batched-tokens, always (vLLM's flag; "
        "--no-enable-chunked-prefill is refused)",
    )
    static_batching: StaticBatching | None = setting(
        None,
        "baseline for benchmarks: admit a new batch only when the last one is done; padded: "
        "finished rows compute until the batch ends (as HF generate); compact: they leave",
    )
    static_fill_timeout: float = setting(
        1.0, "static batching: open a batch once full or once its first request waited this long"
    )
    async_scheduling: bool = setting(
        True,
        "plan the next step while the executor runs this one (stops it reveals take effect a "
        "step later, unseen by clients); --no-async-scheduling: lockstep, as static batching",
    )
    speculative_config: str | None = setting(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M}: each decoding row verifies up to K '
        "tokens drafted from its own earlier tokens in one step; plans then go in lockstep",
    )

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill:
            raise ValueError("--no-enable-chunked-prefill: prompts are always computed in chunks")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.static_batching not in (None, "padded", "compact"):
            raise ValueError(f"unknown static batching mode {self.static_batching!r}")
        if self.speculation is not None and self.static_batching is not None:
            raise ValueError("--speculative-config does not run with --static-batching")

    @property
    def speculation(self) -> Speculation | None:
        return parse_speculation(self.speculative_config)


@dataclass(slots=True, frozen=True)
class MetricsConfig:
    """Prometheus metrics (the gateway's are on its own port, at /metrics)"""

    metrics_port: int | None = setting(
        None, "serve /metrics here (serve: the scheduler's; the executor's is the next port)"
    )
    metrics_host: str = setting("127.0.0.1", "the metrics server's address")
    disable_log_stats: bool = setting(
        False, "no periodic stats line from the scheduler (throughput, queues, KV cache; vLLM's)"
    )
    log_stats_interval: float = setting(
        10.0, "seconds between those lines (vLLM's VLLM_LOG_STATS_INTERVAL)"
    )

    def __post_init__(self) -> None:
        if self.log_stats_interval <= 0:
            raise ValueError("--log-stats-interval must be positive (--disable-log-stats: none)")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What the scheduler runs with once an executor has said how many KV blocks it holds."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    scheduling: SchedulingConfig = nested(SchedulingConfig)
    # Where every layer of the model slides (`ModelInfo.kv_window`): blocks behind it are freed.
    sliding_window: int = 0
    # The LoRA adapters one step may run (the executors' `--max-loras`); 0: a request may name
    # none.
    max_loras: int = 0
    max_logprobs: int = 20  # the engine's `--max-logprobs`; -1: the vocabulary's size
    # An encoder's (`ModelInfo.encoder_only`): each prompt computed in one step, never in
    # chunks, and never from a cached prefix (every token attends the whole prompt).
    whole_prompts: bool = False

    @property
    def enable_lora(self) -> bool:
        return self.max_loras > 0

    @property
    def prefix_caching(self) -> bool:
        return self.scheduling.enable_prefix_caching and not self.whole_prompts

    @property
    def token_budget(self) -> int:
        given = self.scheduling.max_num_batched_tokens
        return token_budget(given, self.max_model_len, self.whole_prompts)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        if self.token_budget < self.max_num_seqs:
            # Every running decode gets its token each step only if the budget covers them all.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.whole_prompts and self.token_budget < self.max_model_len:
            raise ValueError(whole_prompts_refusal(self.token_budget, self.max_model_len))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def blocks_held(self, tokens: int) -> int:
        """The most blocks a sequence of `tokens` holds at once: all of them, or with a sliding
        window the window's and the chunk computed next, each starting mid-block."""
        held = -(-tokens // self.block_size)
        if self.sliding_window:
            chunk = self.sliding_window + self.token_budget
            held = min(held, -(-chunk // self.block_size) + 1)
        return held
