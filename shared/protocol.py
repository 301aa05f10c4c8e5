"""Wire protocol between gateway, scheduler and executors (msgspec Structs, msgpack-encoded).

Integer arrays travel as little-endian int32 bytes (`pack_ids` / `unpack_ids`): four bytes an id,
no per-element encoding work, and numpy reads them back without a copy.
"""

from __future__ import annotations

from typing import Final

import msgspec
import numpy as np

PROTOCOL_VERSION: Final = 8

ID_DTYPE: Final = np.dtype("<i4")


class FrameError(ValueError):
    """A frame that decoded but whose fields do not fit together; the receiver drops it."""


def pack_ids(ids: np.ndarray | list[int]) -> bytes:
    return np.asarray(ids, dtype=ID_DTYPE).tobytes() if len(ids) else b""


def unpack_ids(raw: bytes) -> np.ndarray:
    if len(raw) % ID_DTYPE.itemsize:
        raise FrameError(f"an id array of {len(raw)} bytes is not a whole number of ids")
    return np.frombuffer(raw, dtype=ID_DTYPE)


class Grammar(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A request's output constraint, compiled by the executor (xgrammar): `kind` "json"
    (`spec` a JSON schema; empty: any JSON object), "regex" or "ebnf" (xgrammar's EBNF)."""

    kind: str
    spec: str = ""
    any_whitespace: bool = True  # JSON: any whitespace between elements, else one space


GRAMMAR_KINDS: Final = ("json", "regex", "ebnf")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What the executor needs to pick a token; stop conditions stay with the scheduler."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: the sampled token's and the top N
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: list[tuple[int, float]] = []
    allowed_token_ids: list[int] = []
    bad_words: list[list[int]] = []  # token sequences, the last token banned after the rest
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = []  # banned while fewer than min_tokens are generated
    prompt_logprobs: int | None = None  # N: each prompt token's logprob and the top N
    grammar: Grammar | None = None  # structured output: the tokens it allows, each step
    # A reasoning model's </think>, where the answer starts inside its thinking (-1: it does
    # not): a grammar constrains only what follows it, and once `thinking_budget` tokens were
    # generated without it, it is the only token allowed (-1: no budget).
    think_end: int = -1
    thinking_budget: int = -1
    # An embeddings request's: the hidden state of its last prompt token (after the final
    # norm) comes back with its first token, as an `Embedding`.
    embed: bool = False
    # An encoder's pair (BERT's cross-encoders): the prompt position where the second text
    # starts, its tokens' type 1 (the first's 0); -1: one text, every token's type 0.
    second_text: int = -1


class Embedding(msgspec.Struct, array_like=True, frozen=True):
    """A request's last prompt token's hidden state, little-endian float32, unnormalized."""

    req_id: int
    vector: bytes


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Logprobs of a request's prompt tokens `first`, `first` + 1, ...: per token
    [(token, logprob), top N...] and its rank among the vocabulary (1: the likeliest)."""

    req_id: int
    first: int
    entries: list[list[tuple[int, float]]]
    ranks: list[int]


def adjusts_logits(sampling: SamplingParams) -> bool:
    """Whether a request changes its logits before sampling (penalties, bias, masks)."""
    return bool(
        sampling.logit_bias or sampling.allowed_token_ids or sampling.bad_words
        or sampling.min_tokens or sampling.repetition_penalty != 1.0
        or sampling.frequency_penalty or sampling.presence_penalty
    )  # fmt: skip


def constrains(sampling: SamplingParams) -> bool:
    """Whether the executor masks a request's tokens on the host: a grammar, a thinking budget."""
    return sampling.grammar is not None or sampling.thinking_budget >= 0


class LoraRef(msgspec.Struct, array_like=True, frozen=True):
    """The LoRA adapter a request runs: its name (for logs), its PEFT folder, and its files'
    digest (`shared/lora.py`), which keys the executor's copy and the prefix cache."""

    name: str
    path: str
    digest: str


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A request joining the executor's persistent batch, sent in full exactly once per admission.

    `token_ids` holds every known token (prompt, then tokens generated before a preemption);
    the first `num_computed` of them already have KV in `block_ids` (prefix-cache hits).
    """

    req_id: int
    token_ids: bytes
    num_prompt_tokens: int
    num_computed: int
    num_scheduled: int
    block_ids: bytes
    sampling: SamplingParams = SamplingParams()
    lora: LoraRef | None = None  # the LoRA adapter it runs; None: the base model


class PlanDrafts(msgspec.Struct, array_like=True, frozen=True):
    """Speculative decoding: each decoding row of `req_ids` appends its `counts` drafted tokens
    (`tokens`, rows concatenated) before the step, computes them with its one missing token
    (its override count is 1 + drafts) and samples after each; the result says which stood."""

    req_ids: bytes
    counts: bytes
    tokens: bytes


class BatchPlan(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, tag=1):
    """One step of the batch, as a diff against the executor's persistent batch.

    Applied in this order: drop `removed` rows (finished, aborted or preempted), append `new` rows,
    then every continuing row computes one token unless `override_ids` gives it
    `override_counts` tokens (a prefill chunk, or 0 when the budget ran out). Continuing rows take
    the blocks they newly need from `new_block_ids`, in row order. In steady decode the plan is a
    step number and the new block ids (17 bytes plus 4 per id), whatever the batch size.
    `drafts` (speculative decoding) come before the counts are applied.
    """

    step: int
    new_block_ids: bytes = b""
    removed: bytes = b""
    new: list[NewRequest] = []
    override_ids: bytes = b""
    override_counts: bytes = b""
    drafts: PlanDrafts | None = None


class StepResult(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, tag=2):
    """Sampled ids for the rows that reached the end of their known tokens, in row order.
    With drafts, a row's ids are the drafts that stood and the token after them: `num_sampled`
    says how many each row has (empty: one each), and `logprobs` follows `sampled`."""

    step: int
    sampled: bytes = b""
    num_sampled: bytes = b""
    logprobs: list[list[tuple[int, float]]] = []
    prompt_logprobs: list[PromptLogprobs] = []
    # (req_id, reason, why): requests it cannot run, for a reason of REFUSED_BY_EXECUTOR
    refused: list[tuple[int, str, str]] = []
    embeddings: list[Embedding] = []


# Why an executor refuses a request: its grammar does not compile (or refused a token), or
# its LoRA adapter cannot be loaded.
REFUSED_BY_EXECUTOR: Final = ("grammar", "adapter")


class StepFailed(msgspec.Struct, array_like=True, frozen=True, tag=10):
    """The executor could not run this step (`error` names the exception) and is exiting:
    the scheduler re-queues the step's rows and holds the ones that were computing their prompt
    as suspects (see `RequestLifecycle.restart`)."""

    step: int
    error: str


class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, tag=3):
    """A tokenized request entering the scheduler. `req_id` is the sending gateway's own
    (below 2**24): the scheduler keys it by gateway too, so ids never collide across gateways or
    their restarts. `priority`: lower runs earlier, as in vLLM."""

    req_id: int
    prompt_ids: bytes
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str = ""  # vLLM's: only requests of the same salt share cached KV blocks
    lora: LoraRef | None = None  # the LoRA adapter it runs; None: the base model


class AbortRequest(msgspec.Struct, array_like=True, frozen=True, tag=4):
    """End a request of the sending gateway's; another gateway's ids are out of its reach."""

    req_id: int


class Finished(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """How a request ended: "stop", "length", "abort", or refused: "error" (invalid),
    "grammar" (its output constraint does not compile), "adapter" (its LoRA adapter cannot be
    loaded), "overloaded" (the waiting queue is
    full), "unavailable" (no executor), "failed" (its executor died twice while running it);
    `error` says why."""

    req_id: int
    reason: str
    error: str = ""
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was admitted


class EngineOutputs(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, tag=5):
    """One step's new tokens (parallel `req_ids` / `token_ids`) and the requests that ended."""

    step: int
    req_ids: bytes = b""
    token_ids: bytes = b""
    finished: list[Finished] = []
    logprobs: list[list[tuple[int, float]]] = []  # aligned with req_ids when any was asked
    prompt_logprobs: list[PromptLogprobs] = []
    embeddings: list[Embedding] = []  # before the tokens of their requests


class Register(msgspec.Struct, array_like=True, frozen=True, tag=6):
    """An executor introducing itself; the scheduler refuses a peer whose settings differ."""

    version: int
    rank: int
    model: str
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_loras: int = 0  # the LoRA adapters it keeps loaded (`--max-loras`); 0: it runs none


class RegisterReply(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, tag=7):
    """Accepted: the first plan will carry `first_step`. Refused: `reason` says why; with
    `retry` the executor registers again a moment later (the scheduler restarted and does not
    know it, or its rank's previous process is not yet seen gone), else it exits."""

    accepted: bool
    reason: str = ""
    first_step: int = 1
    retry: bool = False


class Heartbeat(msgspec.Struct, array_like=True, frozen=True, tag=9):
    """An idle executor's sign of life, once a second; a gateway's (rank 0), which also
    introduces it to a scheduler that restarted; from the scheduler, a probe."""

    rank: int


class SchedulerStatus(msgspec.Struct, array_like=True, frozen=True, tag=8):
    """Sent to the gateway about twice a second, and whenever readiness changes. `instance`
    is new each time a scheduler process starts: a gateway that sees it change knows the
    requests it was waiting on are gone."""

    instance: int
    ready: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int = 0  # the KV cache's size, once an executor has registered


ToScheduler = AddRequest | AbortRequest | Heartbeat
FromScheduler = EngineOutputs | SchedulerStatus
ExecutorToScheduler = Register | StepResult | StepFailed | Heartbeat
SchedulerToExecutor = RegisterReply | BatchPlan | Heartbeat
