"""What every HTTP request passes through: the API key's check, and errors as OpenAI bodies."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from turnstile.gateway_svc.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


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


def required_key(api_key: str | None) -> Middleware:
    """With an API key set, /v1/ wants `Authorization: Bearer <key>`; /health and /metrics stay
    open for probes and scrapers."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    return check
