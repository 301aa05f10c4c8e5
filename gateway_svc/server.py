"""Runs the gateway: aiohttp on uvloop, cancelling a handler when its client disconnects."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvloop
from aiohttp import web

from gateway_svc.app import Gateway
from gateway_svc.engine_client import EngineClient
from shared.model_info import read_model_info, served_name
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DRAIN_SECONDS = 60.0


async def _serve(
    model: Path,
    scheduler_address: str,
    host: str,
    port: int,
    api_key: str | None,
    max_body_bytes: int,
    max_model_len: int | None,
    request_timeout: float,
) -> None:
    info = read_model_info(model)
    engine = EngineClient(scheduler_address, request_timeout)
    engine.start()
    gateway = Gateway(
        engine,
        Tokenizer(model, info),
        served_name(model),
        min(max_model_len or info.max_model_len, info.max_model_len),
        api_key,
    )
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request and frees its KV blocks.
    runner = web.AppRunner(gateway.app(max_body_bytes), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, shutdown_timeout=DRAIN_SECONDS).start()
    log.info("gateway listening on http://%s:%d", host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: stop listening, let the requests under way finish, then leave.
    log.info("draining")
    await runner.cleanup()
    await engine.close()


def serve_gateway(
    model: Path,
    scheduler_address: str,
    host: str,
    port: int,
    api_key: str | None,
    max_body_bytes: int,
    max_model_len: int | None,
    request_timeout: float,
) -> None:
    uvloop.run(
        _serve(
            model,
            scheduler_address,
            host,
            port,
            api_key,
            max_body_bytes,
            max_model_len,
            request_timeout,
        )
    )
