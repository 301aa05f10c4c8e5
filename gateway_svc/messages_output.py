"""A Messages API request's answer (`messages_api.py` reads the request): the `message`, whole
or as Anthropic's stream of events (message_start, each content block's start, deltas and
stop, message_delta, message_stop): the model's thinking (with --reasoning-parser), its text,
and the tool calls found in its answer as tool_use blocks."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from turnstile.gateway_svc.answer_parts import streamed_parts, whole_answer, write_parts
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.generation import Generation
from turnstile.gateway_svc.reasoning import ReasoningReaders
from turnstile.gateway_svc.tool_calls import Call, CallReader


class MessageObject:
    """The `message` of one request, as it stands."""

    def __init__(self, model: str) -> None:
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.content: list[dict[str, Any]] = []  # the blocks done, in order
        self.calls: CallReader | None = None  # where the request has tools
        self.reasoning: ReasoningReaders | None = None  # with --reasoning-parser

    def body(self, stop: tuple[str | None, str | None], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": anthropic_usage(usage)}  # fmt: skip


def anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts input tokens read from the cache apart from the others (as vLLM)."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": usage["completion_tokens"]}  # fmt: skip


def tool_use(call: Call) -> dict[str, Any]:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"],
            "input": json.loads(function["arguments"] or "{}")}  # fmt: skip


def stop_reason(finish: str, generation: Generation, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: a stop string matched, or its end."""
    if finish == "length":
        return "max_tokens", None
    matched = generation.choices[0].text.matched
    if matched is not None and not called:
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


async def answer_whole(
    _: web.Request, shape: MessageObject, generation: Generation
) -> web.Response:
    reasoning, text, calls, finish = await whole_answer(generation, shape.reasoning, shape.calls)
    if reasoning:
        shape.content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not (calls or reasoning):  # an empty answer is an empty text block
        shape.content.append({"type": "text", "text": text})
    shape.content += [tool_use(call) for call in calls]
    body = shape.body(stop_reason(finish or "stop", generation, bool(calls)), generation.usage())
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


class _Blocks:
    """A stream's content blocks as they open and close: thinking while it comes, text while
    it comes, each tool call whole as the reader completes it."""

    def __init__(self, response: web.StreamResponse, shape: MessageObject) -> None:
        self.response, self.shape = response, shape
        self.kind: str | None = None  # the block open: "text" or "thinking"
        self.index = -1

    async def write(self, kind: str, **fields: Any) -> None:
        body = msgspec.json.encode({"type": kind, **fields})
        await self.response.write(b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n")

    async def open(self, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.kind = block["type"]
        await self.write("content_block_start", index=self.index, content_block=block)

    async def text(self, delta: str, kind: str = "text") -> None:
        """`delta` onto the open block of `kind`, "text" or "thinking" (its field's name)."""
        if self.kind != kind:
            await self.open({"type": kind, kind: ""})
        change = {"type": f"{kind}_delta", kind: delta}
        await self.write("content_block_delta", index=self.index, delta=change)

    async def close(self) -> None:
        if self.kind is not None:
            await self.write("content_block_stop", index=self.index)
            self.kind = None

    async def call(self, call: Call) -> None:
        block = tool_use(call)
        await self.open(block | {"input": {}})
        change = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        await self.write("content_block_delta", index=self.index, delta=change)
        await self.close()


async def answer_stream(
    http: web.Request, shape: MessageObject, generation: Generation
) -> web.StreamResponse:
    response, parts = await streamed_parts(http, generation, shape.reasoning, shape.calls)
    blocks = _Blocks(response, shape)
    started = shape.body((None, None), generation.usage() | {"completion_tokens": 0})
    await blocks.write("message_start", message=started)
    try:
        finish, called = await write_parts(parts, blocks, "thinking")
    except ApiError as exc:
        error = {"type": exc.kind, "message": exc.message}
        await blocks.write("error", error=error)
        await response.write_eof()
        return response
    if blocks.index < 0:
        await blocks.text("")  # an empty answer is an empty text block
    await blocks.close()
    reason, sequence = stop_reason(finish, generation, called)
    usage = {"output_tokens": generation.usage()["completion_tokens"]}
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    await blocks.write("message_delta", delta=delta, usage=usage)
    await blocks.write("message_stop")
    await response.write_eof()
    return response
