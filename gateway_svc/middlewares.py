"""What every HTTP request passes through: a browser's cross-origin checks (CORS), the API key's
check, and errors as OpenAI's bodies (Anthropic's on its Messages API)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp_cors
from aiohttp import web

from turnstile.gateway_svc.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(_body(request, exc), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        error = ApiError(exc.status, exc.reason, kind)
        return web.json_response(_body(request, error), status=exc.status)


def _body(request: web.Request, error: ApiError) -> dict[str, Any]:
    if request.path.startswith("/v1/messages"):  # Anthropic's API, its errors' shape
        return {"type": "error", "error": {"type": error.kind, "message": error.message}}
    return error.body()


def required_key(api_key: str | None) -> Middleware:
    """With an API key set, /v1/ wants `Authorization: Bearer <key>`; /health and /metrics stay
    open for probes and scrapers."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        # a browser's preflight carries no credentials: CORS answers it (vLLM's order)
        if api_key and request.path.startswith("/v1/") and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    return check


def allow_cross_origin(
    app: web.Application,
    origins: tuple[str, ...],
    methods: tuple[str, ...],
    headers: tuple[str, ...],
    credentials: bool,
) -> None:
    """Every route answers browsers' cross-origin requests and their preflights from
    `origins` (vLLM's --allowed-origins and its siblings; "*": any), with aiohttp-cors; call it
    once every route is added."""
    options = aiohttp_cors.ResourceOptions(
        allow_credentials=credentials,
        allow_methods="*" if "*" in methods else methods,
        allow_headers="*" if "*" in headers else headers,
        max_age=600,  # as Starlette's, which vLLM's answers come from
    )
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        cors.add(route)
