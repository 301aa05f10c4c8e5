"""OpenAI's Responses API (`POST /v1/responses`), stateless as vLLM serves it without a store:
the request becomes a chat (instructions as the system message, the input's messages after
it), runs as one, and is answered as a `response` object or as its stream of typed events.
What a stateless text server cannot do (stored responses, tools, reasoning, background runs)
is refused by name."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.generation import SSE_HEADERS, Generation
from turnstile.gateway_svc.request_types import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    RequestId,
    ResponseFormat,
    TokenCount,
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


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (False,),  # nothing is kept: no response can be fetched or continued
        "previous_response_id": (),
        "conversation": (),
        "prompt": (),
        "tools": ([],),
        "tool_choice": ("none", "auto"),
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
    parallel_tool_calls: bool | None = None  # no tools: nothing to call
    request_id: RequestId | None = None  # vLLM's: the response's id, as given
    store: refused("false") = None
    previous_response_id: refused("null") = None
    conversation: refused("null") = None
    prompt: refused("null") = None
    tools: refused("empty") = None
    tool_choice: refused('"none" or "auto"') = None
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

    def as_chat(self) -> ChatCompletionRequest:
        """The chat this request runs as, its fields checked."""
        refuse_unsupported(self, self.REFUSED)
        messages = [ChatMessage("system", self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage("user", self.input))
        else:
            messages += [_message(item, i) for i, item in enumerate(self.input)]
        chat = ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            response_format=_format(self.text),
        )  # fmt: skip
        chat.check()
        return chat


def _message(item: dict[str, Any], index: int) -> ChatMessage:
    """An input item as a chat message: only messages of text."""
    where = f"input[{index}]"
    if item.get("type", "message") != "message":
        raise ApiError(400, f"{where}: only message items are supported", param=f"{where}.type")
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


class ResponseObject:
    """The `response` of one request, as it stands, and its stream's events."""

    def __init__(self, asked: ResponsesRequest, model: str) -> None:
        self.asked, self.model = asked, model
        self.id = asked.request_id or f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence = 0

    def body(self, status: str, text: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        asked = self.asked
        output = [] if text is None else [self.item(text, "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": asked.instructions, "max_output_tokens": asked.max_output_tokens,
            "temperature": asked.temperature, "top_p": asked.top_p,
            "parallel_tool_calls": bool(asked.parallel_tool_calls), "tool_choice": "none",
            "tools": [], "previous_response_id": None, "reasoning": None, "store": False,
            "text": {"format": msgspec.to_builtins(
                asked.text.format if asked.text and asked.text.format else {"type": "text"}
            )}, "truncation": "disabled", "metadata": asked.metadata or {},
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }  # fmt: skip

    def item(self, text: str, status: str) -> dict[str, Any]:
        content = [self.part(text)] if status == "completed" else []
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event, numbered in sequence as OpenAI's."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"

    def at_text(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0, **fields}


async def answer_whole(shape: ResponseObject, generation: Generation) -> web.Response:
    texts, finish = [], "stop"
    async for piece in generation.pieces():
        texts.append(piece.text)
        finish = piece.finish_reason or finish
    status = "incomplete" if finish == "length" else "completed"
    body = shape.body(status, "".join(texts), generation.usage())
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def answer_stream(
    http: web.Request, shape: ResponseObject, generation: Generation
) -> web.StreamResponse:
    pieces = generation.pieces()
    piece = await anext(pieces)  # a refused request still gets its HTTP status
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(http)
    started = shape.body("in_progress", None, None)
    await response.write(shape.event("response.created", response=started))
    await response.write(shape.event("response.in_progress", response=started))
    await response.write(shape.event("response.output_item.added", output_index=0,
                                     item=shape.item("", "in_progress")))  # fmt: skip
    await response.write(shape.event("response.content_part.added", **shape.at_text(
        part=shape.part("")
    )))  # fmt: skip
    texts, finish = [], "stop"
    try:
        while piece is not None:
            finish = piece.finish_reason or finish
            if piece.text:
                texts.append(piece.text)
                await response.write(shape.event("response.output_text.delta", **shape.at_text(
                    delta=piece.text, logprobs=[]
                )))  # fmt: skip
            piece = await anext(pieces, None)
    except ApiError as exc:
        error = exc.body()["error"]
        await response.write(shape.event("error", code=error["code"], message=error["message"],
                                         param=error["param"]))  # fmt: skip
        await response.write_eof()
        return response
    text = "".join(texts)
    await response.write(shape.event("response.output_text.done", **shape.at_text(
        text=text, logprobs=[]
    )))  # fmt: skip
    await response.write(shape.event("response.content_part.done", **shape.at_text(
        part=shape.part(text)
    )))  # fmt: skip
    await response.write(shape.event("response.output_item.done", output_index=0,
                                     item=shape.item(text, "completed")))  # fmt: skip
    status = "incomplete" if finish == "length" else "completed"
    done = shape.body(status, text, generation.usage())
    await response.write(shape.event(f"response.{status}", response=done))
    await response.write_eof()
    return response
