"""What an OpenAI request becomes: the prompt's token ids and the scheduler's `AddRequest`,
with the model's defaults filled in and anything that cannot run refused as a 400."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from turnstile.gateway_svc.sampling_fields import RequestDefaults, sampling_params
from turnstile.gateway_svc.token_requests import TokenizeChat
from turnstile.gateway_svc.tool_calls import template_message, template_tools
from turnstile.shared.protocol import AddRequest, Grammar, LoraRef, SchedulerStatus, pack_ids
from turnstile.shared.tokenizer import Tokenizer

Request = CompletionRequest | ChatCompletionRequest


def parse(body: bytes, kind: type[Request]) -> Any:
    """A generation request, validated."""
    request = parse_body(body, kind)
    request.check()
    return request


def parse_body(body: bytes, kind: type[Any]) -> Any:
    """`body` decoded as `kind`; whatever does not fit is a 400 naming the field."""
    try:
        # Lax like pydantic: 1.0 is accepted where an integer is expected.
        request = msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", param=_field_of(str(exc))) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    return request


def _field_of(error: str) -> str | None:
    """The field a msgspec error names: "Object contains unknown field `x` - at `$.a`", or
    "Expected `int`, got `str` - at `$.a`"."""
    unknown = re.search(r"unknown field `([^`]*)`", error)
    at = re.search(r"- at `\$\.?([^`]*)`", error)
    path = at.group(1) if at else ""
    if unknown:
        return f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path or None


def message_text(message: ChatMessage) -> str:
    """Text of a message whose content is a string or a list of text parts."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def check_prompt_size(request: Request, max_model_len: int, max_chars_per_token: int) -> None:
    """Refuse, before tokenizing, a prompt text too long to fit the context in any case."""
    if isinstance(request, ChatCompletionRequest):
        sizes = [sum(len(message_text(m)) for m in request.messages)]
    else:
        sizes = [len(p) for p in request.prompts()]
    if max(sizes) > max_model_len * max_chars_per_token:
        raise ApiError(
            400,
            f"the prompt has {max(sizes)} characters: more than this model's context of "
            f"{max_model_len} tokens can hold",
            code="context_length_exceeded",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )


def chat_text(request: ChatCompletionRequest | TokenizeChat, tokenizer: Tokenizer) -> str:
    """The conversation as the model's chat template writes it."""
    messages = []
    for message in request.messages:
        fields = {k: v for k, v in msgspec.structs.asdict(message).items() if v is not None}
        if thinking := message.reasoning or message.reasoning_content:  # templates read any
            fields |= {"reasoning": thinking, "reasoning_content": thinking, "thinking": thinking}
        messages.append(template_message(fields | {"content": message_text(message)}))
    tools = template_tools(request) if isinstance(request, ChatCompletionRequest) else None
    effort = request.reasoning_effort if isinstance(request, ChatCompletionRequest) else None
    if effort is not None and "reasoning_effort" not in (tokenizer.info.chat_template or ""):
        raise ApiError(400, "reasoning_effort: this model's chat template does not read it",
                       param="reasoning_effort")  # fmt: skip
    try:
        return tokenizer.render_chat(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **({"tools": tools} if tools else {}),
            **({"reasoning_effort": effort} if effort else {}),
            **(request.chat_template_kwargs or {}),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def prompts_of(request: Request, tokenizer: Tokenizer) -> list[list[int]]:
    """Each prompt's token ids: the texts tokenized, the ids given, or the rendered chat."""
    special = request.add_special_tokens
    if isinstance(request, ChatCompletionRequest):
        return [tokenizer.encode(chat_text(request, tokenizer), special)]
    prompts = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            prompts.append(tokenizer.encode(prompt, special))
        elif any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise ApiError(
                400, f"prompt token ids must lie in [0, {tokenizer.vocab_size})", param="prompt"
            )
        else:
            prompts.append(list(prompt))
    return prompts


def truncated(prompts: list[list[int]], request: Request, max_model_len: int) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens` for generation: each prompt's last k tokens."""
    keep = kept_tokens(request.truncate_prompt_tokens, max_model_len)
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def kept_tokens(keep: int | None, max_model_len: int) -> int | None:
    """How many tokens `truncate_prompt_tokens` keeps (-1: the context's length; None:
    all); more than the context is refused."""
    if keep is not None and keep > max_model_len:
        raise ApiError(
            400, f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
            f"({max_model_len}): select a smaller truncation size",
            param="truncate_prompt_tokens",
        )  # fmt: skip
    return max_model_len if keep == -1 else keep


def hidden_token_ids(request: Request, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a request and whose text is not shown (as vLLM, unless
    include_stop_str_in_output)."""
    if request.include_stop_str_in_output:
        return frozenset()
    hidden = set(request.stop_token_ids or ())
    return frozenset(hidden if request.ignore_eos else hidden | set(eos_token_ids))


def engine_request(
    request: Request,
    prompt_ids: list[int],
    max_model_len: int,
    tokenizer: Tokenizer,
    defaults: RequestDefaults | None = None,
    kv_tokens: int | None = None,
    grammar: Grammar | None = None,
    think_end: int = -1,
    lora: LoraRef | None = None,
) -> AddRequest:
    """The scheduler's view of a request; refuses one that cannot fit the context. Sampling
    fields it leaves out take `defaults` (the model's), else neutral values; a chat without
    max_tokens may run to the end of the context, or of the KV cache (`kv_tokens`), or to the
    model's max_new_tokens; none runs past the server's limit.
    `grammar`: the output's constraint; `think_end`: a reasoning model's </think>, where the
    answer starts inside its thinking (with the chat's thinking_token_budget); `lora`: the
    adapter it runs (None: none)."""
    chat = isinstance(request, ChatCompletionRequest)
    budget = request.thinking_token_budget if isinstance(request, ChatCompletionRequest) else None
    asked = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        asked = request.max_completion_tokens
    prompt_len = len(prompt_ids)
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    room = max_model_len - prompt_len
    if room < 1 or (asked is not None and asked > room):
        wanted = prompt_len + (asked or 1)
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} tokens ({prompt_len} in the prompt, {wanted - prompt_len} for "
            "the completion). Please shorten the prompt or lower max_tokens.",
            code="context_length_exceeded",
            param="max_tokens" if room >= 1 else "messages" if chat else "prompt",
        )
    if asked == 0:  # completions' echo alone: a token is computed, not answered (as vLLM)
        asked = 1
    defaults = defaults or RequestDefaults()
    if asked is None:  # completions: 16, as OpenAI and vLLM; chat: the rest of the context
        fits = room if kv_tokens is None else max(min(room, kv_tokens - prompt_len), 1)
        fits = min(fits, defaults.max_tokens or fits)
        asked = min(room, CompletionRequest.DEFAULT_MAX_TOKENS) if not chat else fits
    asked = min(asked, defaults.max_tokens_limit or asked)
    return AddRequest(
        req_id=0,
        prompt_ids=pack_ids(prompt_ids),
        max_tokens=asked,
        sampling=msgspec.structs.replace(
            sampling_params(request, tokenizer, defaults.sampling, asked),
            grammar=grammar,
            think_end=think_end,
            thinking_budget=-1 if budget is None or think_end < 0 else budget,
        ),
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        priority=request.priority,
        cache_salt=request.cache_salt or "",
        lora=lora,
    )


def check_logprobs(request: Request, limit: int) -> None:
    """Each count of top logprobs at most the server's `--max-logprobs`, as vLLM refuses more."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(request, name, None)
        if type(value) is int and value > limit:
            raise ApiError(400, f"{name} must be at most {limit} (the server's --max-logprobs)",
                           param=name)  # fmt: skip


def check_capacity(
    status: SchedulerStatus | None, size: int, prompt: int, max_tokens: int, n: int
) -> None:
    """Refuse `n` choices whose KV blocks, the prompt's shared, exceed the whole cache
    (`status`: the scheduler's last, with its number of blocks of `size` tokens)."""
    if n == 1 or status is None or not status.num_blocks:
        return
    own = -(-(prompt + max_tokens) // size) - prompt // size
    needed = prompt // size + n * own
    if needed > status.num_blocks:
        raise ApiError(
            400,
            f"n={n} choices of this prompt need {needed} KV blocks; the cache holds "
            f"{status.num_blocks}. Lower n or max_tokens.",
            param="n",
        )
