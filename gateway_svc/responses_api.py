"""OpenAI's Responses API (`POST /v1/responses`): the request becomes a chat (instructions as the
system message, then a stored previous response's conversation, `responses_store.py`, then the
input's items: messages, earlier function calls and their outputs), runs as one, and is answered
as a `response` object or its stream of typed events (`responses_output.py`). Function tools are
the chat's tools. What a text server cannot do (built-in tools, reasoning, background runs) is
refused by name."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    RequestId,
    ResponseFormat,
    TokenCount,
    Tool,
    Unused,
    refuse_unsupported,
    refused,
)

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: refused("null") = None


class FunctionTool(FunctionDefinition, kw_only=True):
    """A function the model may call, flat as this API writes it; the only kind of tool served
    (no built-in tools)."""

    type: Literal["function"]


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "conversation": (),
        "prompt": (),
        "reasoning": (),
        "include": ([],),
        "background": (False,),
        "top_logprobs": (0,),
        "max_tool_calls": (),
        "truncation": ("disabled",),
    }

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is one call
    request_id: RequestId | None = None  # vLLM's: the response's id, as given
    # Kept for previous_response_id and GET (None: kept where the server keeps any, as OpenAI)
    store: bool | None = None
    previous_response_id: str | None = None  # continues that stored response's conversation
    conversation: refused("null") = None
    prompt: refused("null") = None
    reasoning: refused("null") = None
    include: refused("empty") = None
    background: refused("false") = None
    top_logprobs: refused("0") = None
    max_tool_calls: refused("null") = None
    truncation: refused('"disabled"') = None
    metadata: Unused = None
    user: Unused = None
    service_tier: Unused = None
    safety_identifier: Unused = None
    prompt_cache_key: Unused = None

    def turn(self, history: list[ChatMessage]) -> list[ChatMessage]:
        """`history` (a previous response's conversation) and this request's input after it."""
        messages = list(history)
        if isinstance(self.input, str):
            messages.append(ChatMessage("user", self.input))
        else:
            for i, item in enumerate(self.input):
                add_item(messages, item, f"input[{i}]")
        return messages

    def as_chat(self, turn: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat this request runs as (the instructions, then `turn`), its fields
        checked. A previous response's instructions are not carried over, as OpenAI's."""
        refuse_unsupported(self, self.REFUSED)
        system = [ChatMessage("system", self.instructions)] if self.instructions else []
        choice = self.tool_choice
        if choice == "auto" and not self.tools:
            choice = None  # OpenAI's default, with nothing to call: no calls
        chat = ChatCompletionRequest(
            messages=system + turn, model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            response_format=_format(self.text), parallel_tool_calls=self.parallel_tool_calls,
            tools=[Tool("function", FunctionDefinition(t.name, t.description, t.parameters,
                                                       t.strict)) for t in self.tools or []],
            tool_choice=NamedToolChoice("function", FunctionName(choice.name))
            if isinstance(choice, FunctionChoice) else choice,
        )  # fmt: skip
        chat.check()
        return chat


def add_item(messages: list[ChatMessage], item: dict[str, Any], where: str) -> None:
    """An item (of an input, or a response's output) onto the chat: a message of text, a call
    the model made (onto the assistant's message before it, as a chat holds a turn's calls), or
    a call's output."""
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "message":
        message = _message(item, where)
        if message.role == "assistant" and _thinking_alone(last):  # its thinking came first
            messages[-1] = msgspec.structs.replace(last, content=message.content)
        else:
            messages.append(message)
    elif kind == "reasoning":  # the model's thinking, before the message or calls it led to
        parts = item.get("content") or []
        texts = [p.get("text") for p in parts if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            raise ApiError(400, f"{where}: a reasoning item's content must be reasoning_text "
                           "parts", param=f"{where}.content")  # fmt: skip
        messages.append(ChatMessage("assistant", None, reasoning="".join(texts)))
    elif kind == "function_call":
        fields = _strings(item, where, "call_id", "name", "arguments")
        try:
            json.loads(fields["arguments"])
        except ValueError:
            raise ApiError(400, f"{where}: arguments must be JSON",
                           param=f"{where}.arguments") from None  # fmt: skip
        call = {"id": fields["call_id"], "type": "function",
                "function": {"name": fields["name"], "arguments": fields["arguments"]}}  # fmt: skip
        if last is not None and last.role == "assistant":  # a copy: stored turns stay as kept
            messages[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []),
                                                                     call])  # fmt: skip
        else:
            messages.append(ChatMessage("assistant", None, tool_calls=[call]))
    elif kind == "function_call_output":
        fields = _strings(item, where, "call_id", "output")
        messages.append(ChatMessage("tool", fields["output"], tool_call_id=fields["call_id"]))
    else:
        raise ApiError(
            400, f"{where}: only message, reasoning, function_call and function_call_output "
            "items are supported", param=f"{where}.type",
        )  # fmt: skip


def _thinking_alone(message: ChatMessage | None) -> bool:
    """An assistant's message that holds only its thinking (a reasoning item) so far."""
    return (message is not None and message.role == "assistant" and message.content is None
            and message.reasoning is not None and not message.tool_calls)  # fmt: skip


def _strings(item: dict[str, Any], where: str, *names: str) -> dict[str, str]:
    for name in names:
        if not isinstance(item.get(name), str):
            raise ApiError(400, f"{where}: {name} must be a string", param=f"{where}.{name}")
    return {name: item[name] for name in names}


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    """A message item: a string, or parts of text."""
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise ApiError(400, f"{where}: role must be one of {', '.join(_ROLES)}",
                       param=f"{where}.role")  # fmt: skip
    role = "system" if role == "developer" else role  # as OpenAI's models without the role
    if isinstance(content, str):
        return ChatMessage(role, content)
    parts = content if isinstance(content, list) else []
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
    if not parts or len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, f"{where}: content must be a string or input_text parts",
                       param=f"{where}.content")  # fmt: skip
    return ChatMessage(role, "".join(texts))


def _format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    if fmt.name is None:
        raise ApiError(400, "text.format of type json_schema needs its name",
                       param="text.format.name")  # fmt: skip
    return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name, fmt.schema, fmt.description))
