"""OpenAI request bodies as msgspec Structs. Decoding validates them: a field no Struct declares
is refused by name, and a declared field Turnstile does not implement is refused unless it holds
its no-op value (`REFUSED`). The OpenAPI document is generated from these types."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from turnstile.gateway_svc.errors import ApiError

MAX_STOP_STRINGS = 8
MAX_PROMPTS = 256  # in one completions request
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's limit
PRIORITY_LIMIT = 1 << 20  # the scheduler packs (priority, arrival) into one int64

TokenCount = Annotated[int, Meta(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Logprobs = Annotated[int, Meta(ge=0)]  # at most the server's --max-logprobs (`openai_api.py`)
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RequestId = Annotated[str, Meta(pattern=r"^[!-~]{1,256}$")]  # printable: a header's value too
# Accepted, not used: hints for OpenAI's own billing, storage and abuse tracking.
Unused = Annotated[Any, Meta(description="accepted and not used")]


def refused(no_op: str) -> Any:
    return Annotated[Any, Meta(description=f"not supported: refused unless {no_op}")]


def refuse_unsupported(request: Any, refused_fields: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first `refused` field that holds other than a no-op value."""
    for name, no_ops in refused_fields.items():
        if (value := getattr(request, name)) is not None and value not in no_ops:
            raise ApiError(400, f"{name} is not supported by this server",
                           code="unsupported_parameter", param=name)  # fmt: skip


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an assistant's thinking (vLLM's name), for the template
    reasoning_content: str | None = None  # the same: SGLang's and DeepSeek's name


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's constraints on the output (one of json, regex, choice, grammar, json_object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None  # xgrammar's EBNF (GBNF-like)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # one grammar engine, never a fallback: holds either way


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Fields declared below that Turnstile refuses unless they hold one of these no-op values
    # (None, a field left out, always passes).
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "best_of": (1,),
        "store": (False,),
        "return_hidden_states": (False,),
    }

    model: str | None = None
    max_tokens: TokenCount | None = None
    # Unset: the model's generation_config.json default (--generation-config auto), else neutral.
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100, le=100)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None = None  # fmt: skip
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    bad_words: list[str] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Only the slow (Python) tokenizers tell spaces between special tokens; ours are fast.
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: Annotated[int, Meta(ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)] = 0
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    best_of: refused("1") = None
    # vLLM's beam search (`beam_search.py`): n beams, ranked with length_penalty
    use_beam_search: bool = False
    length_penalty: Annotated[float, Meta(ge=-10, le=10)] = 1.0
    # vLLM's: each prompt's last k tokens (the chat's as templated); -1: the context's length
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids
    return_tokens_as_token_ids: bool | None = None  # vLLM's: "token_id:N"; None: the server's
    request_id: RequestId | None = None  # vLLM's: the response's id is "chatcmpl-" or "cmpl-" it
    # vLLM's: only requests of the same salt share prefix-cached KV blocks (tenants apart)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    prompt_logprobs: Logprobs | None = None  # vLLM's: each prompt token's logprob, top N
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    store: refused("false") = None
    user: Unused = None
    metadata: Unused = None
    service_tier: Unused = None
    safety_identifier: Unused = None
    prompt_cache_key: Unused = None  # a routing hint; prefix caching needs none
    # SGLang's (sglang-router sends them in every request it forwards)
    no_stop_trim: bool = False  # the stop string or token kept: include_stop_str_in_output
    return_hidden_states: refused("false") = None

    def check(self) -> None:
        """What the types cannot say."""
        self.include_stop_str_in_output |= self.no_stop_trim
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")
        if self.truncate_prompt_tokens == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 (the context's length) or "
                           "at least 1", param="truncate_prompt_tokens")  # fmt: skip
        if self.prompt_top is not None and self.stream:
            param = "prompt_logprobs" if self.prompt_logprobs is not None else "echo"
            raise ApiError(400, f"the prompt's logprobs ({param}) are answered whole, not "
                           "streamed", code="unsupported_parameter", param=param)  # fmt: skip
        refuse_unsupported(self, self.REFUSED)

    @property
    def prompt_top(self) -> int | None:
        """The top tokens each prompt position's logprobs bring; None: not computed."""
        return self.prompt_logprobs

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling, kw_only=True):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {**_Sampling.REFUSED, "suffix": ("",)}
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16  # OpenAI's and vLLM's, for completions

    prompt: str | Annotated[list[int | str | list[int]], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None  # 0: echo alone
    logprobs: Logprobs | None = None
    echo: bool = False  # the prompt's text before each choice's (and its logprobs')
    suffix: refused("null") = None
    add_special_tokens: bool = True  # the tokenizer's BOS, as vLLM

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt "
                           "alone)", param="max_tokens")  # fmt: skip
        if isinstance(self.prompt, list) and len({type(p) for p in self.prompt}) > 1:
            raise ApiError(
                400, "prompt must be a string, a list of token ids, or a list of either",
                param="prompt",
            )  # fmt: skip
        if len(self.prompts()) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request", param="prompt")

    @property
    def prompt_top(self) -> int | None:
        """With echo and logprobs, the prompt's tokens' logprobs too, as vLLM."""
        if not self.echo or self.logprobs is None:
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # a forced call always follows its schema


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling, kw_only=True):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Sampling.REFUSED,
        "functions": ([],),
        "function_call": ("none",),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "verbosity": (),
        "web_search_options": (),
        "chat_template": (),
        "documents": (),
        "echo": (False,),
        "moderation": (),
        "prompt_cache_options": (),
        "prompt_cache_retention": ("in_memory",),  # what a prefix cache in memory gives
    }

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens, as vLLM
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is one call
    functions: refused("empty") = None
    function_call: refused('"none"') = None
    audio: refused("null") = None
    modalities: refused('["text"]') = None
    prediction: refused("null") = None
    # vLLM's: given to the chat template (gpt-oss's writes it into its system message); refused
    # where the template does not read it
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    verbosity: refused("null") = None
    web_search_options: refused("null") = None
    chat_template: refused("null (serve with --chat-template)") = None
    documents: refused("null") = None
    echo: refused("false") = None
    moderation: refused("null") = None
    prompt_cache_options: refused("null") = None
    prompt_cache_retention: refused('"in_memory"') = None
    # With --reasoning-parser (without one, each holds either way): vLLM's include_reasoning
    # (false: the thinking is left out); SGLang's separate_reasoning (false: it stays in
    # `content`) and stream_reasoning (false: streamed in one piece once it ends).
    include_reasoning: bool = True
    # vLLM's: </think> is forced once the thinking took this many tokens
    thinking_token_budget: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def check(self) -> None:
        super().check()
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                400, "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )  # fmt: skip
