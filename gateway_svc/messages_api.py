"""Anthropic's Messages API (`POST /v1/messages`, as vLLM serves it): the request becomes a chat
(the system prompt, then the messages: text blocks, the model's earlier tool_use blocks as its
tool calls, tool_result blocks as the tools' answers), runs as one, and is answered as a
`message` or its stream of events (`messages_output.py`). What a text server cannot do (images,
documents, extended thinking, server tools) is refused by name."""

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
    NamedToolChoice,
    TokenCount,
    Tool,
    Unused,
    refuse_unsupported,
    refused,
)


class MessagesTool(msgspec.Struct, forbid_unknown_fields=True):
    """A tool the model may call; only custom tools (no server tools)."""

    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Unused = None


class MessagesToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the one to call
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "thinking": ({"type": "disabled"},),
        "container": (),
        "mcp_servers": ([],),
    }

    model: str
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_tokens: TokenCount
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: refused('{"type": "disabled"}') = None
    container: refused("null") = None
    mcp_servers: refused("empty") = None
    metadata: Unused = None
    service_tier: Unused = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat this request runs as, its fields checked."""
        refuse_unsupported(self, self.REFUSED)
        messages = [ChatMessage("system", _text(self.system, "system"))] if self.system else []
        for i, message in enumerate(self.messages):
            add_message(messages, message, f"messages[{i}]")
        choice = self.tool_choice
        chat = ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=self.stop_sequences, stream=self.stream,
            tools=[Tool("function", FunctionDefinition(t.name, t.description, t.input_schema))
                   for t in self.tools or []] or None,
            tool_choice=_tool_choice(choice) if self.tools else None,
            parallel_tool_calls=None if choice is None or choice.disable_parallel_tool_use is None
            else not choice.disable_parallel_tool_use,
        )  # fmt: skip
        chat.check()
        return chat


class MessagesCount(MessagesRequest, kw_only=True):
    """What /v1/messages/count_tokens reads: a request without max_tokens."""

    max_tokens: TokenCount = 1


def _tool_choice(choice: MessagesToolChoice | None) -> str | NamedToolChoice:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "tool_choice of type tool needs its name", param="tool_choice.name")
        return NamedToolChoice("function", FunctionName(choice.name))
    return "required" if choice.type == "any" else "none"


def add_message(messages: list[ChatMessage], message: dict[str, Any], where: str) -> None:
    """A user's or the assistant's message onto the chat: its text, the assistant's tool_use
    blocks as its calls, a user's tool_result blocks as tool messages before its text."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise ApiError(400, f"{where}: role must be user or assistant", param=f"{where}.role")
    if isinstance(content, str):
        messages.append(ChatMessage(role, content))
        return
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(400, f"{where}: content must be a string or a list of content blocks",
                       param=f"{where}.content")  # fmt: skip
    texts, calls, thinking = [], [], None
    for j, block in enumerate(content):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text([block], at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            answer = block.get("content", "")
            output = answer if isinstance(answer, str) else _text(answer, f"{at}.content")
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise ApiError(400, f"{at}: tool_use_id must be a string",
                               param=f"{at}.tool_use_id")  # fmt: skip
            messages.append(ChatMessage("tool", output, tool_call_id=tool_id))
        elif kind == "thinking" and role == "assistant":  # its thinking, for the template
            thinking = block.get("thinking") if isinstance(block.get("thinking"), str) else None
        else:
            raise ApiError(400, f"{at}: a {role}'s {kind} block is not supported (text, tool_use, "
                           "tool_result and thinking are)", param=f"{at}.type")  # fmt: skip
    if texts or calls or role == "assistant":
        messages.append(ChatMessage(role, "".join(texts) if texts or not calls else None,
                                    tool_calls=calls or None, reasoning=thinking))  # fmt: skip


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block as a chat's tool call."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise ApiError(400, f"{where}: a tool_use block needs an id, a name and an input object",
                       param=where)  # fmt: skip
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks' text joined; anything else refused."""
    if isinstance(blocks, str):
        return blocks
    listed = blocks if isinstance(blocks, list) else []
    texts = [b.get("text") for b in listed if isinstance(b, dict) and b.get("type") == "text"]
    if not listed or len(texts) != len(listed) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, f"{where}: must be a string or text blocks", param=where)
    return "".join(texts)
