"""A one-choice answer's text read into its thinking (with --reasoning-parser), its text and the
tool calls found in it (with tools), whole or piece by piece: what the Responses and Messages
APIs both answer from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

from aiohttp import web

from turnstile.gateway_svc.generation import SSE_HEADERS, Generation
from turnstile.gateway_svc.reasoning import ReasoningReaders
from turnstile.gateway_svc.tool_calls import Call, CallReader


class Part(NamedTuple):
    thinking: str
    text: str
    calls: list[Call]
    finish_reason: str | None  # set on the last part


async def answer_parts(
    generation: Generation, thinking: ReasoningReaders | None, calls: CallReader | None
) -> AsyncIterator[Part]:
    """The first choice's pieces as they come, each read into its parts."""
    async for piece in generation.pieces():
        text, found, thought = piece.text, [], ""
        if thinking is not None:
            thought, text = thinking.step(0, text, piece.finish_reason is not None)
        if calls is not None:
            text, found, _ = calls.step(text, piece.finish_reason)
        yield Part(thought, text, found, piece.finish_reason)


async def streamed_parts(
    http: web.Request,
    generation: Generation,
    thinking: ReasoningReaders | None,
    calls: CallReader | None,
) -> tuple[web.StreamResponse, AsyncIterator[Part]]:
    """The stream's response, opened once the first part came (a refused request still gets
    its HTTP status), and every part."""
    parts = answer_parts(generation, thinking, calls)
    first = await anext(parts)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(http)

    async def every() -> AsyncIterator[Part]:
        yield first
        async for part in parts:
            yield part

    return response, every()


class PartWriter(Protocol):
    """A stream's writer of the parts: text of a kind (the answer's, or its thinking's), calls."""

    async def text(self, delta: str, kind: str = ...) -> None: ...

    async def call(self, call: Call) -> None: ...


async def write_parts(
    parts: AsyncIterator[Part], writer: PartWriter, thinking: str
) -> tuple[str, bool]:
    """Every part onto `writer`, its thinking as text of kind `thinking`; the finish reason, and
    whether a call came."""
    finish, called = "stop", False
    async for part in parts:
        finish = part.finish_reason or finish
        if part.thinking:
            await writer.text(part.thinking, thinking)
        if part.text:
            await writer.text(part.text)
        for call in part.calls:
            await writer.call(call)
            called = True
    return finish, called


async def whole_answer(
    generation: Generation, thinking: ReasoningReaders | None, calls: CallReader | None
) -> Part:
    """The first choice's answer once it ends, read into its parts."""
    texts, finish = [], "stop"
    async for piece in generation.pieces():
        texts.append(piece.text)
        finish = piece.finish_reason or finish
    text, found, thought = "".join(texts), [], ""
    if thinking is not None:
        thought, text = thinking.whole(0, text)
    if calls is not None:
        text, found, _ = calls.whole(text, finish)
    return Part(thought or "", text, found, finish)
