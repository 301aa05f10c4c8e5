"""The HTTP answer of a completions or chat request: its choices' pieces gathered into one
body, or sent as server-sent events as they come."""

from __future__ import annotations

import msgspec
from aiohttp import web

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.generation import SSE_HEADERS, Generation, Logprobs, Piece, Request
from turnstile.gateway_svc.request_types import CompletionRequest
from turnstile.gateway_svc.responses import ResponseShape


async def answer_whole(shape: ResponseShape, generation: Generation) -> web.Response:
    count = len(generation.choices)
    texts: list[list[str]] = [[] for _ in range(count)]
    entries: list[Logprobs] = [[] for _ in range(count)]
    token_ids: list[list[int]] = [[] for _ in range(count)]
    finish = ["stop"] * count
    async for piece in generation.pieces():
        texts[piece.index].append(piece.text)
        entries[piece.index] += piece.logprobs
        token_ids[piece.index] += piece.token_ids
        finish[piece.index] = piece.finish_reason or finish[piece.index]
    choices, request = [], generation.request
    for i, choice in enumerate(generation.choices):
        text, calls, reason, reasoning = "".join(texts[i]), [], finish[i], None
        if shape.reasoning is not None:
            reasoning, text = shape.reasoning.whole(i, text)
        if shape.calls is not None:
            text, calls, reason = shape.calls[i].whole(text, reason)
        logprobs = shape.logprobs(entries[i], len(choice.echo))
        if choice.echo and isinstance(request, CompletionRequest) and request.logprobs is not None:
            first = generation.choices[i - i % generation.n]  # its prompt's, which brought them
            prompt = shape.echo_logprobs(first.prompt_ids, first.prompt_logprobs, request.logprobs)
            logprobs = prompt if logprobs is None else {k: prompt[k] + logprobs[k] for k in prompt}
        choices.append((text, reason, logprobs, calls, token_ids[i], reasoning))
    top = request.prompt_logprobs
    prompts = [shape.prompt_logprobs(c.prompt_logprobs, top) for c in generation.choices]
    body = shape.whole(choices, generation.usage(), prompts if top is not None else None)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def answer_stream(
    http: web.Request, shape: ResponseShape, generation: Generation, request: Request
) -> web.StreamResponse:
    options = request.stream_options
    pieces = generation.pieces()
    # The first piece is awaited before answering, so a refused request still gets its
    # proper HTTP status instead of an error inside a 200 stream.
    piece: Piece | None = await anext(pieces)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(http)
    offsets = [0] * len(generation.choices)
    started = [False] * len(generation.choices)
    token_ids: list[list[int]] = [[] for _ in generation.choices]  # not sent yet
    try:
        while piece is not None:
            i, text, calls, reason = piece.index, piece.text, [], piece.finish_reason
            reasoning = ""
            if shape.reasoning is not None:
                reasoning, text = shape.reasoning.step(i, text, reason is not None)
            if shape.calls is not None:
                text, calls, reason = shape.calls[i].step(text, reason)
            logprobs = shape.logprobs(piece.logprobs, offsets[i])
            offsets[i] += len(text)
            usage = generation.usage() if options and options.continuous_usage_stats else None
            token_ids[i] += piece.token_ids
            if text or calls or reason or logprobs or reasoning or not started[i]:
                chunk = shape.chunk(
                    i, text, reason, logprobs, not started[i], usage, calls, token_ids[i],
                    reasoning,
                )  # fmt: skip
                token_ids[i] = []
                started[i] = True
                await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            piece = await anext(pieces, None)
    except ApiError as exc:
        await response.write(b"data: " + msgspec.json.encode(exc.body()) + b"\n\n")
    if options and options.include_usage:
        chunk = shape.usage_chunk(generation.usage())
        await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
