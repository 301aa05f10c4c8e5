"""The OpenAI-compatible HTTP API (aiohttp): validate, tokenize, submit, stream back."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from turnstile.gateway_svc import metrics
from turnstile.gateway_svc.engine_client import End, EngineClient, RequestStream
from turnstile.gateway_svc.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_size,
    engine_request,
    parse,
    prompt_of,
)
from turnstile.gateway_svc.openapi import openapi_document
from turnstile.gateway_svc.responses import ResponseShape
from turnstile.gateway_svc.text_stream import TextStream
from turnstile.shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# How a refusal from the scheduler reaches the client: status, OpenAI error type, headers.
_REFUSALS = {
    "error": (400, "invalid_request_error", {}),
    "overloaded": (429, "rate_limit_exceeded", {"Retry-After": "1"}),
    "unavailable": (503, "service_unavailable", {"Retry-After": "5"}),
    "timeout": (504, "timeout", {}),
    "failed": (500, "server_error", {}),
}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class Piece:
    """Text that became safe to send, with the logprobs of the tokens behind it."""

    text: str
    logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        error = ApiError(exc.status, exc.reason, kind)
        return web.json_response(error.body(), status=exc.status)


class Gateway:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        api_key: str | None = None,
        sampling_defaults: dict[str, float] | None = None,
    ) -> None:
        self.engine = engine
        self.sampling_defaults = sampling_defaults or {}
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        # Tokenizing off the event loop: a long prompt must not stall every other stream.
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(
            middlewares=[openai_errors, self._require_key], client_max_size=max_body_bytes
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _require_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """With an API key set, /v1/ wants `Authorization: Bearer <key>`; /health and
        /metrics stay open for probes and scrapers."""
        if self.api_key and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    async def health(self, _: web.Request) -> web.Response:
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "turnstile",
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.model_name, self.max_model_len))

    async def metrics(self, _: web.Request) -> web.Response:
        response = web.Response(body=generate_latest())
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse(await http.read(), CompletionRequest))

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse(await http.read(), ChatCompletionRequest))

    async def _generate(
        self, http: web.Request, request: CompletionRequest | ChatCompletionRequest
    ) -> web.StreamResponse:
        arrival = time.perf_counter()
        if request.model not in (None, "", self.model_name):
            raise ApiError(
                404, f"the model {request.model!r} does not exist", "not_found_error",
                "model_not_found",
            )  # fmt: skip
        chat = isinstance(request, ChatCompletionRequest)
        endpoint = "chat" if chat else "completions"
        check_prompt_size(request, self.max_model_len, self.tokenizer.max_chars_per_token)
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, prompt_of, request, self.tokenizer
        )
        message = engine_request(request, prompt_ids, self.max_model_len, self.sampling_defaults)
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        stream = self.engine.submit(message)
        metrics.GATEWAY_PROMPT_TOKENS.inc(len(prompt_ids))
        shape = ResponseShape(chat, self.model_name, stream.req_id, self.tokenizer)
        counter = _Usage(len(prompt_ids), arrival)
        pieces = self._pieces(stream, TextStream(self.tokenizer, request.stop_strings), counter)
        try:
            if request.stream:
                include_usage = bool(
                    request.stream_options and request.stream_options.include_usage
                )
                response = await self._stream(http, shape, pieces, counter, include_usage)
            else:
                response = await self._whole(shape, pieces, counter)
        except ApiError as exc:
            metrics.REQUESTS.labels(endpoint, str(exc.status)).inc()
            raise
        finally:
            self.engine.abort(stream)  # a no-op unless the client left early
        metrics.REQUESTS.labels(endpoint, "200").inc()
        metrics.E2E_LATENCY.observe(time.perf_counter() - arrival)
        return response

    async def _pieces(
        self, stream: RequestStream, text: TextStream, usage: _Usage
    ) -> AsyncIterator[Piece]:
        entries: list[list[tuple[int, float]]] = []
        while True:
            event = await stream.events.get()
            if isinstance(event, End):
                if event.reason in _REFUSALS:
                    status, kind, headers = _REFUSALS[event.reason]
                    raise ApiError(status, event.error, kind, headers=headers)
                yield Piece(
                    text.finish(), entries, "stop" if event.reason == "stop" else event.reason
                )
                return
            usage.token()
            if event.logprobs:
                entries.append(event.logprobs)
            piece = text.add(event.token_id)
            if text.stopped:
                self.engine.abort(stream)
                yield Piece(piece, entries, "stop")
                return
            if piece:
                yield Piece(piece, entries)
                entries = []

    async def _whole(
        self, shape: ResponseShape, pieces: AsyncIterator[Piece], usage: _Usage
    ) -> web.Response:
        texts: list[str] = []
        entries: list[list[tuple[int, float]]] = []
        finish_reason = "stop"
        async for piece in pieces:
            texts.append(piece.text)
            entries += piece.logprobs
            finish_reason = piece.finish_reason or finish_reason
        body = shape.whole("".join(texts), finish_reason, shape.logprobs(entries, 0), usage.body())
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _stream(
        self,
        http: web.Request,
        shape: ResponseShape,
        pieces: AsyncIterator[Piece],
        usage: _Usage,
        include_usage: bool,
    ) -> web.StreamResponse:
        # The first piece is awaited before answering, so a refused request still gets its
        # proper HTTP status instead of an error inside a 200 stream.
        first = await anext(pieces)
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(http)
        offset = 0
        piece: Piece | None = first
        is_first = True
        try:
            while piece is not None:
                logprobs = shape.logprobs(piece.logprobs, offset)
                offset += len(piece.text)
                chunk = shape.chunk(piece.text, piece.finish_reason, logprobs, first=is_first)
                await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                is_first = False
                piece = await anext(pieces, None)
        except ApiError as exc:
            await response.write(b"data: " + msgspec.json.encode(exc.body()) + b"\n\n")
        if include_usage:
            chunk = shape.usage_chunk(usage.body())
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Usage:
    """Token counts and the latency series they feed."""

    def __init__(self, prompt_tokens: int, arrival: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._last = arrival

    def token(self) -> None:
        now = time.perf_counter()
        histogram = (
            metrics.INTER_TOKEN_LATENCY if self.completion_tokens else metrics.TIME_TO_FIRST_TOKEN
        )
        histogram.observe(now - self._last)
        self._last = now
        self.completion_tokens += 1
        metrics.GATEWAY_GENERATION_TOKENS.inc()

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
