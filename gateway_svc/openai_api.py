"""OpenAI request bodies as msgspec Structs: decoding validates them, and every failure becomes
a 400 with an OpenAI-style error body."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.shared.tokenizer import Tokenizer

MAX_STOP_STRINGS = 8
PRIORITY_LIMIT = 1 << 20  # the scheduler packs (priority, arrival) into one int64


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code or kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[dict[str, Any]] | None = None


# Bounds live in the types: msgspec enforces them while decoding, and the OpenAPI document
# publishes them.
TokenCount = Annotated[int, Meta(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Logprobs = Annotated[int, Meta(ge=0, le=20)]


class _Sampling(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str | None = None
    max_tokens: TokenCount | None = None
    # Unset: the model's generation_config.json default (--generation-config auto), else neutral.
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: Annotated[int, Meta(ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)] = 0
    n: Annotated[int, Meta(ge=1, le=1, description="only 1 is supported")] = 1
    user: str | None = None

    def check(self) -> None:
        """What the types cannot say."""

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int | str]
    logprobs: Logprobs | None = None
    echo: bool = False

    def check(self) -> None:
        super().check()
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], str):
                self.prompt = prompt[0]
            elif not all(isinstance(t, int) for t in prompt):
                raise ApiError(400, "prompt must be a string, one string, or a list of token ids")
        if self.echo:
            raise ApiError(400, "echo is not supported", code="unsupported_parameter")


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ApiError(400, "messages must not be empty")


def parse(body: bytes, kind: type[_Sampling]) -> Any:
    try:
        # Lax like pydantic: 1.0 is accepted where an integer is expected.
        request = msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    request.check()
    return request


def message_text(message: ChatMessage) -> str:
    """Text of a message whose content is a string or a list of text parts."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def check_prompt_size(
    request: CompletionRequest | ChatCompletionRequest, max_model_len: int, max_chars_per_token: int
) -> None:
    """Refuse, before tokenizing, a prompt text too long to fit the context in any case."""
    if isinstance(request, ChatCompletionRequest):
        chars = sum(len(message_text(m)) for m in request.messages)
    else:
        chars = len(request.prompt)
    if chars > max_model_len * max_chars_per_token:
        raise ApiError(
            400,
            f"the prompt has {chars} characters: more than this model's context of "
            f"{max_model_len} tokens can hold",
            code="context_length_exceeded",
        )


def prompt_of(
    request: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer
) -> list[int]:
    """Prompt token ids: the text tokenized, the ids given, or the rendered chat."""
    if isinstance(request, ChatCompletionRequest):
        messages = [{"role": m.role, "content": message_text(m)} for m in request.messages]
        try:
            return tokenizer.encode(tokenizer.render_chat(messages))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    ids = [int(t) for t in request.prompt]
    if any(not 0 <= t < tokenizer.vocab_size for t in ids):
        raise ApiError(400, f"prompt token ids must lie in [0, {tokenizer.vocab_size})")
    return ids


def logprobs_of(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
# Fields a generation_config.json may set that Turnstile does not apply: only their no-op value.
UNAPPLIED_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0}  # fmt: skip


def model_sampling_defaults(found: dict[str, float] | None) -> dict[str, float]:
    """The model's sampling defaults (generation_config.json's), for requests that leave them
    out. One Turnstile would not apply is refused by name, never ignored."""
    defaults = dict(found or {})
    for name, neutral in UNAPPLIED_SAMPLING.items():
        if name in defaults and defaults.pop(name) != neutral:
            raise ValueError(
                f"the model's generation_config.json sets {name}, which Turnstile does not "
                "implement; serve with --generation-config none to leave its defaults out"
            )
    return defaults


def engine_request(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_model_len: int,
    sampling_defaults: dict[str, float] | None = None,
) -> AddRequest:
    """The scheduler's view of a request; refuses one that cannot fit the context. Sampling
    fields it leaves out take `sampling_defaults` (the model's), else neutral values."""
    defaults = {**NEUTRAL_SAMPLING, **(sampling_defaults or {})}

    def sampling(name: str) -> float:
        value = getattr(request, name)
        return defaults[name] if value is None else value

    asked = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        asked = request.max_completion_tokens
    prompt_len = len(prompt_ids)
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty")
    room = max_model_len - prompt_len
    if room < 1 or (asked is not None and asked > room):
        wanted = prompt_len + (asked or 1)
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} tokens ({prompt_len} in the prompt, {wanted - prompt_len} for "
            "the completion). Please shorten the prompt or lower max_tokens.",
            code="context_length_exceeded",
        )
    return AddRequest(
        req_id=0,
        prompt_ids=pack_ids(prompt_ids),
        max_tokens=asked if asked is not None else room,
        sampling=SamplingParams(
            temperature=sampling("temperature"),
            top_p=sampling("top_p"),
            top_k=max(int(sampling("top_k")), 0),
            seed=request.seed,
            logprobs=logprobs_of(request),
        ),
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        priority=request.priority,
    )
