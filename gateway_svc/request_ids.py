"""The id a generation request is answered under (vLLM's order: the client's `X-Request-Id`
header, the body's `request_id`, a fresh one), sent back as the `X-Request-Id` header; and
each answer's end: counted in the request metrics, and the line `--enable-log-requests` logs."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from turnstile.gateway_svc import metrics
from turnstile.gateway_svc.errors import ApiError

log = logging.getLogger(__name__)

REQUEST_ID = "request_id"  # where a generation keeps the id it answers under


def answer_id(http: web.Request, asked: str | None) -> str:
    """The id `http` is answered under, given its body's `request_id` (`asked`)."""
    http[REQUEST_ID] = http.headers.get("X-Request-Id") or asked or uuid.uuid4().hex
    return http[REQUEST_ID]


async def request_id_header(http: web.Request, response: web.StreamResponse) -> None:
    """X-Request-Id on an answer: the client's, else the id its generation answered under."""
    if request_id := http.headers.get("X-Request-Id") or http.get(REQUEST_ID):
        response.headers["X-Request-Id"] = request_id


def log_ended(
    http: web.Request, endpoint: str, status: str, arrival: float, usage: dict[str, Any]
) -> None:
    """One line a request: its id, endpoint, status ("aborted": the client went away), tokens
    (`usage`, as `Generation.usage` counts them) and seconds; never its prompt or answer."""
    log.info("request %s (%s) %s: %d prompt tokens (%d cached), %d generated, %.3f s",
             http.get(REQUEST_ID), endpoint, status, usage["prompt_tokens"],
             usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"],
             time.perf_counter() - arrival)  # fmt: skip


async def answered(
    http: web.Request,
    endpoint: str,
    arrival: float,
    answer: Awaitable[web.StreamResponse],
    usage: Callable[[], dict[str, Any]],
    log_requests: bool,
) -> web.StreamResponse:
    """`answer`, counted by its status ("aborted": the client went away) and, with
    `log_requests`, logged as it ends with its `usage()`."""
    status = "aborted"  # unless it ends otherwise
    try:
        response = await answer
        status = "200"
    except ApiError as exc:
        status = str(exc.status)
        metrics.REQUESTS.labels(endpoint, status).inc()
        raise
    finally:
        if log_requests:
            log_ended(http, endpoint, status, arrival, usage())
    metrics.REQUESTS.labels(endpoint, "200").inc()
    metrics.E2E_LATENCY.observe(time.perf_counter() - arrival)
    return response
