"""A Responses API request's answer (`responses_api.py` reads the request): the `response`
object, whole or as OpenAI's numbered stream of typed events, its output items in order: the
model's thinking (with --reasoning-parser), the assistant's messages of text and the function
calls found in its answer (a `CallReader`, as a chat's)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from turnstile.gateway_svc.answer_parts import streamed_parts, whole_answer, write_parts
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.generation import Generation
from turnstile.gateway_svc.reasoning import ReasoningReaders
from turnstile.gateway_svc.responses_api import ResponsesRequest
from turnstile.gateway_svc.tool_calls import Call, CallReader


class ResponseObject:
    """The `response` of one request, as it stands, and its stream's events."""

    def __init__(self, asked: ResponsesRequest, model: str) -> None:
        self.asked, self.model = asked, model
        self.id = asked.request_id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done, in order
        self.calls: CallReader | None = None  # where the request has tools
        self.reasoning: ReasoningReaders | None = None  # with --reasoning-parser
        self.stored = False  # kept by the server's store once finished
        self.final: dict[str, Any] | None = None  # the body as it finished

    def body(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        asked = self.asked
        choice = asked.tool_choice or ("auto" if asked.tools else "none")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": self.output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": asked.instructions, "max_output_tokens": asked.max_output_tokens,
            "temperature": asked.temperature, "top_p": asked.top_p,
            "parallel_tool_calls": asked.parallel_tool_calls is not False,
            "tool_choice": msgspec.to_builtins(choice),
            "tools": msgspec.to_builtins(asked.tools or []),
            "previous_response_id": asked.previous_response_id, "reasoning": None,
            "store": self.stored,
            "text": {"format": msgspec.to_builtins(
                asked.text.format if asked.text and asked.text.format else {"type": "text"}
            )}, "truncation": "disabled", "metadata": asked.metadata or {},
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": usage.get(
                    "completion_tokens_details", {}).get("reasoning_tokens", 0)},
                "total_tokens": usage["total_tokens"],
            },
        }  # fmt: skip

    @staticmethod
    def item(kind: str, item_id: str, text: str, status: str) -> dict[str, Any]:
        """A "message" item of the assistant's text, or a "reasoning" item of its thinking."""
        content = [ResponseObject.part(kind, text)] if status == "completed" else []
        if kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
                    "content": content}  # fmt: skip
        return {"id": item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    @staticmethod
    def part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def function_call(call: Call) -> dict[str, Any]:
        function = call["function"]
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"]}  # fmt: skip

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event, numbered in sequence as OpenAI's."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


async def answer_whole(
    _: web.Request, shape: ResponseObject, generation: Generation
) -> web.Response:
    reasoning, text, calls, finish = await whole_answer(generation, shape.reasoning, shape.calls)
    if reasoning:
        shape.output.append(shape.item("reasoning", f"rs_{uuid.uuid4().hex}", reasoning,
                                       "completed"))  # fmt: skip
    if text or not calls:  # an answer without calls is a message, even an empty one
        shape.output.append(shape.item("message", f"msg_{uuid.uuid4().hex}", text, "completed"))
    shape.output += [shape.function_call(call) for call in calls]
    shape.final = shape.body(_status(finish or "stop"), generation.usage())
    return web.Response(body=msgspec.json.encode(shape.final), content_type="application/json")


class _Events:
    """A stream's events as its output items open and close: a reasoning item while thinking
    comes, a message while text comes, each call as the reader completes it."""

    def __init__(self, response: web.StreamResponse, shape: ResponseObject) -> None:
        self.response, self.shape = response, shape
        self.item_id: str | None = None  # the item of text open
        self.kind = "message"  # its kind: "message" or "reasoning"
        self.texts: list[str] = []

    async def write(self, kind: str, **fields: Any) -> None:
        await self.response.write(self.shape.event(kind, **fields))

    def at_text(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.shape.output),
                "content_index": 0, **fields}  # fmt: skip

    async def open(self, kind: str) -> None:
        await self.close()
        self.kind, self.texts = kind, []
        self.item_id = f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
        item = self.shape.item(kind, self.item_id, "", "in_progress")
        await self.write("response.output_item.added", output_index=len(self.shape.output),
                         item=item)  # fmt: skip
        part = self.shape.part(kind, "")
        await self.write("response.content_part.added", **self.at_text(part=part))

    async def text(self, delta: str, kind: str = "message") -> None:
        if self.item_id is None or self.kind != kind:
            await self.open(kind)
        self.texts.append(delta)
        extra = {"logprobs": []} if kind == "message" else {}
        await self.write(self._event("delta"), **self.at_text(delta=delta, **extra))

    def _event(self, what: str) -> str:
        return f"response.{'reasoning' if self.kind == 'reasoning' else 'output'}_text.{what}"

    async def close(self) -> None:
        if self.item_id is None:
            return
        text, shape, kind = "".join(self.texts), self.shape, self.kind
        extra = {"logprobs": []} if kind == "message" else {}
        await self.write(self._event("done"), **self.at_text(text=text, **extra))
        await self.write("response.content_part.done", **self.at_text(part=shape.part(kind, text)))
        item = shape.item(kind, self.item_id, text, "completed")
        await self.write("response.output_item.done", output_index=len(shape.output), item=item)
        shape.output.append(item)
        self.item_id = None

    async def call(self, call: Call) -> None:
        await self.close()
        item, index = self.shape.function_call(call), len(self.shape.output)
        at = {"item_id": item["id"], "output_index": index}
        await self.write("response.output_item.added", output_index=index,
                         item=item | {"status": "in_progress", "arguments": ""})  # fmt: skip
        await self.write("response.function_call_arguments.delta", **at, delta=item["arguments"])
        await self.write("response.function_call_arguments.done", **at, name=item["name"],
                         arguments=item["arguments"])  # fmt: skip
        await self.write("response.output_item.done", output_index=index, item=item)
        self.shape.output.append(item)


async def answer_stream(
    http: web.Request, shape: ResponseObject, generation: Generation
) -> web.StreamResponse:
    response, parts = await streamed_parts(http, generation, shape.reasoning, shape.calls)
    events = _Events(response, shape)
    started = shape.body("in_progress", None)
    await events.write("response.created", response=started)
    await events.write("response.in_progress", response=started)
    try:
        finish, _ = await write_parts(parts, events, "reasoning")
    except ApiError as exc:
        error = exc.body()["error"]
        await events.write("error", code=error["code"], message=error["message"],
                           param=error["param"])  # fmt: skip
        await response.write_eof()
        return response
    answered = any(item["type"] != "reasoning" for item in shape.output)
    if not answered and (events.item_id is None or events.kind == "reasoning"):
        await events.open("message")  # an empty answer is an empty message
    await events.close()
    status = _status(finish)
    shape.final = shape.body(status, generation.usage())
    await events.write(f"response.{status}", response=shape.final)
    await response.write_eof()
    return response
