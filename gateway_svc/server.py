"""Runs the gateway: aiohttp on uvloop, cancelling a handler when its client disconnects."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from turnstile.gateway_svc.app import Gateway
from turnstile.gateway_svc.config import GatewayServiceConfig
from turnstile.gateway_svc.engine_client import EngineClient
from turnstile.gateway_svc.harmony import check_parsers
from turnstile.gateway_svc.lora_updates import FolderResolver, LoraUpdates
from turnstile.gateway_svc.middlewares import allow_cross_origin
from turnstile.gateway_svc.reasoning import ThinkTokens
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.shared.lora import adapters as lora_adapters
from turnstile.shared.model_info import served_name
from turnstile.shared.tokenizer import read_template, served_tokenizer
from turnstile.shared.zmq_io import scheduler_addresses

log = logging.getLogger(__name__)

DRAIN_SECONDS = 60.0


class UnparsableRequests(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback; sglang-router's
    HTTP/2 probe of each worker it adds is one. The client's fault: one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage):
            record.msg = "a request that could not be parsed was answered 400: %s"
            record.args = (str(error.message).strip().split("\n", 1)[0],)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(record.levelno)


async def _serve(config: GatewayServiceConfig) -> None:
    model, settings = config.engine.model_path, config.gateway
    info = config.engine.model_info()
    template = None if settings.chat_template is None else read_template(settings.chat_template)
    defaults = settings.request_defaults(info.sampling_defaults)
    engine = EngineClient(scheduler_addresses(config.addresses)[0], settings.request_timeout)
    engine.start()
    tokenizer = served_tokenizer(
        config.engine, info, settings.default_chat_template_kwargs, template
    )
    info = tokenizer.info  # the chat template served
    parser = settings.reasoning_parser
    check_parsers(info, settings.tool_call_parser, parser)
    max_model_len = min(config.engine.max_model_len or info.max_model_len, info.max_model_len)
    names = settings.served_model_name or [served_name(model)]
    adapters = lora_adapters(config.lora, info)
    resolver = None
    if config.lora.lora_resolver_cache_dir is not None:
        base = {config.engine.model, *names}
        folder = Path(config.lora.lora_resolver_cache_dir)
        resolver = FolderResolver(folder, base, info, config.lora.max_lora_rank)
    served = ServedModels(names, adapters, max_model_len, resolver)
    gateway = Gateway(
        engine,
        tokenizer,
        served,
        max_model_len,
        config.engine.block_size,
        settings.api_key,
        defaults,
        settings.auto_tool_parser,
        settings.return_tokens_as_token_ids,
        settings.responses_store_size,
        settings.enable_log_requests,
        ThinkTokens.of(tokenizer, parser) if parser and not info.chat_format else None,
        settings.enable_force_include_usage,
        info.vocab_size if config.engine.max_logprobs < 0 else config.engine.max_logprobs,
        parser == "openai_gptoss",
        settings.metrics_names == "vllm",
    )
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request and frees its KV blocks.
    app = gateway.app(int(settings.max_body_mb * 2**20))
    if config.lora.allow_runtime_lora_updating:
        log.warning("LoRA adapters may be loaded at run time: a client may have any folder "
                    "this server can read loaded")  # fmt: skip
        LoraUpdates(served, info, config.lora.max_lora_rank).register(app)
    allow_cross_origin(app, settings.allowed_origins, settings.allowed_methods,
                       settings.allowed_headers, settings.allow_credentials)  # fmt: skip
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, shutdown_timeout=DRAIN_SECONDS,
                       ssl_context=settings.ssl_context())  # fmt: skip
    await site.start()
    log.info("gateway listening on %s://%s:%d", settings.scheme, settings.host, settings.port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: stop listening, let the requests under way finish, then leave.
    log.info("draining")
    await runner.cleanup()
    await engine.close()


def serve_gateway(config: GatewayServiceConfig) -> None:
    logging.getLogger("aiohttp.server").addFilter(UnparsableRequests())
    uvloop.run(_serve(config))
