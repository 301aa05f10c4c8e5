"""The OpenAI-compatible HTTP API (aiohttp): routes and the small endpoints (the API key and
errors: `middlewares.py`); a generation request's own path is `generation.py`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from turnstile.gateway_svc import messages_output, metrics, responses_output
from turnstile.gateway_svc.beam_search import beam_search_of
from turnstile.gateway_svc.classify import check_generates
from turnstile.gateway_svc.completions_output import answer_stream, answer_whole
from turnstile.gateway_svc.engine_client import EngineClient
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.generation import Choice, Generation
from turnstile.gateway_svc.harmony import counter_of, readers_of
from turnstile.gateway_svc.messages_api import MessagesRequest
from turnstile.gateway_svc.messages_output import MessageObject
from turnstile.gateway_svc.middlewares import openai_errors, required_key
from turnstile.gateway_svc.openai_api import (
    Request,
    check_capacity,
    check_logprobs,
    check_prompt_size,
    engine_request,
    hidden_token_ids,
    parse,
    parse_body,
    prompts_of,
    truncated,
)
from turnstile.gateway_svc.openapi import openapi_document
from turnstile.gateway_svc.pooled_requests import PooledRequests
from turnstile.gateway_svc.pooling_routes import pooling_routes
from turnstile.gateway_svc.reasoning import ReasoningReaders, ThinkTokens, answer_thinks
from turnstile.gateway_svc.request_ids import REQUEST_ID, answer_id, answered, request_id_header
from turnstile.gateway_svc.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from turnstile.gateway_svc.responses import ResponseShape
from turnstile.gateway_svc.responses_api import ResponsesRequest
from turnstile.gateway_svc.responses_output import ResponseObject
from turnstile.gateway_svc.responses_store import ResponsesStore
from turnstile.gateway_svc.sampling_fields import RequestDefaults
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.gateway_svc.structured_output import grammar_of
from turnstile.gateway_svc.token_endpoints import TokenEndpoints
from turnstile.gateway_svc.tool_calls import (
    CallReader,
    CallReaders,
    forced_call,
    keeps_special_tokens,
    tool_mode,
)
from turnstile.shared.metric_names import as_vllms
from turnstile.shared.metrics_server import every_service_metrics
from turnstile.shared.tokenizer import Tokenizer


class Gateway:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        models: ServedModels,
        max_model_len: int,
        block_size: int,
        api_key: str | None = None,
        defaults: RequestDefaults | None = None,
        tool_parser: str | None = None,
        tokens_as_ids: bool = False,
        responses_kept: int = 0,
        log_requests: bool = False,
        think: ThinkTokens | None = None,
        force_usage: bool = False,
        max_logprobs: int = 20,
        harmony_reasoning: bool = False,
        vllm_metrics: bool = False,
    ) -> None:
        self.engine = engine
        self.vllm_metrics = vllm_metrics  # /metrics under vLLM's names (--metrics-names vllm)
        # gpt-oss's answers read as harmony: whether their reasoning is shown; None: not harmony
        self.harmony = harmony_reasoning if tokenizer.info.chat_format == "harmony" else None
        self.max_logprobs = max_logprobs  # --max-logprobs, the vocabulary's size for -1
        self.force_usage = force_usage  # every stream ends with its usage
        self.think = think  # --reasoning-parser's markers: a chat's thinking told apart
        self.log_requests = log_requests  # a line each request as it ends
        self.stored = ResponsesStore(responses_kept)  # for previous_response_id and GET
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids when a request is silent
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused
        self.defaults = defaults  # the model's generation config under the server's flags
        self.tokenizer = tokenizer
        self.served = models  # the names a request may ask for, its LoRA adapters' among them
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.api_key = api_key
        # Tokenizing off the event loop: a long prompt must not stall every other stream.
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(
            middlewares=[openai_errors, required_key(self.api_key)], client_max_size=max_body_bytes
        )
        app.on_response_prepare.append(request_id_header)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        pooled = PooledRequests(self.engine, self.tokenizer, self.max_model_len, self.served,
                                self._tokenizing, self.log_requests)  # fmt: skip
        for path, handler in pooling_routes(pooled):
            app.router.add_post(path, handler)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_get("/v1/models", self.models)
        for path in ("/health", "/ping"):  # /ping: SageMaker's probe, as vLLM serves it
            app.router.add_get(path, self.health)
        app.router.add_post("/ping", self.health)  # vLLM answers both
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        tokens = TokenEndpoints(
            self.tokenizer, self.max_model_len, self.served.lora, self.served.base
        )
        for method, path, handler in tokens.routes():
            app.router.add_route(method, path, handler)
        return app

    async def health(self, _: web.Request) -> web.Response:
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.served.cards()})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.served.all_names(), self.max_model_len))

    async def metrics(self, _: web.Request) -> web.Response:
        """Every service's series under `turnstile serve` (one scrape target per replica, as
        vLLM's API port), else the gateway's own."""
        body = every_service_metrics()
        if self.vllm_metrics:
            body = as_vllms(body, self.served.base)
        response = web.Response(body=body)
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse(await http.read(), CompletionRequest))

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse(await http.read(), ChatCompletionRequest))

    async def responses(self, http: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, run as a chat (`responses_api.py`, `responses_output.py`)."""
        arrival = time.perf_counter()
        asked = parse_body(await http.read(), ResponsesRequest)
        shape = ResponseObject(asked, self.served.reported(asked.model))
        http[REQUEST_ID] = shape.id
        turn = asked.turn(self.stored.history(asked))
        chat = asked.as_chat(turn)
        generation = await self._start(chat, arrival)
        shape.calls, shape.reasoning = self._readers(chat, generation)
        shape.stored = self.stored.keeps(asked)
        output = responses_output.answer_stream if asked.stream else responses_output.answer_whole
        answer = output(http, shape, generation)
        response = await self._answered(http, "responses", arrival, generation, answer)
        if shape.stored and shape.final is not None:
            self.stored.keep(shape.final, turn)
        return response

    async def messages(self, http: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API, run as a chat (`messages_api.py`, `messages_output.py`)."""
        arrival = time.perf_counter()
        asked = parse_body(await http.read(), MessagesRequest)
        shape = MessageObject(self.served.reported(asked.model))
        http[REQUEST_ID] = shape.id
        chat = asked.as_chat()
        generation = await self._start(chat, arrival)
        shape.calls, shape.reasoning = self._readers(chat, generation)
        output = messages_output.answer_stream if asked.stream else messages_output.answer_whole
        answer = output(http, shape, generation)
        return await self._answered(http, "messages", arrival, generation, answer)

    def _readers(
        self, chat: ChatCompletionRequest, generation: Generation
    ) -> tuple[CallReader | None, ReasoningReaders | None]:
        """The first choice's readers of tool calls (with tools) and of thinking."""
        calls = generation.tool_mode is not None
        reader = CallReaders(generation.tool_mode, self.tool_parser, chat)[0] if calls else None
        return reader, readers_of(chat, generation.thinking, calls, self.harmony)

    async def stored_response(self, http: web.Request) -> web.Response:
        return web.json_response(self.stored.body(http.match_info["response_id"]))

    async def delete_response(self, http: web.Request) -> web.Response:
        return web.json_response(self.stored.delete(http.match_info["response_id"]))

    async def _generate(self, http: web.Request, request: Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        if self.force_usage and request.stream:  # vLLM's --enable-force-include-usage
            options = request.stream_options or StreamOptions()
            request.stream_options = msgspec.structs.replace(options, include_usage=True)
        request_id = answer_id(http, request.request_id)
        generation = await self._start(request, arrival)
        chat = isinstance(request, ChatCompletionRequest)
        shape = ResponseShape(chat, self.served.reported(request.model), self.tokenizer, request_id)
        as_ids = request.return_tokens_as_token_ids
        shape.tokens_as_ids = self.tokens_as_ids if as_ids is None else as_ids
        if request.return_token_ids:
            shape.prompt_ids = [c.prompt_ids for c in generation.choices]
        if isinstance(request, ChatCompletionRequest) and generation.tool_mode is not None:
            shape.calls = CallReaders(generation.tool_mode, self.tool_parser, request)
        if isinstance(request, ChatCompletionRequest):
            calls = generation.tool_mode is not None
            shape.reasoning = readers_of(request, generation.thinking, calls, self.harmony)
        if request.stream:
            answer = answer_stream(http, shape, generation, request)
        else:
            answer = answer_whole(shape, generation)
        endpoint = "chat" if chat else "completions"
        return await self._answered(http, endpoint, arrival, generation, answer)

    async def _answered(
        self,
        http: web.Request,
        endpoint: str,
        arrival: float,
        generation: Generation,
        answer: Awaitable[web.StreamResponse],
    ) -> web.StreamResponse:
        try:
            return await answered(
                http, endpoint, arrival, answer, generation.usage, self.log_requests
            )
        finally:
            generation.close()  # a no-op unless the client left early

    async def _start(self, request: Request, arrival: float) -> Generation:
        """The request checked, tokenized and sent to the scheduler as its choices."""
        check_generates(self.tokenizer.info, self.served.base)
        await self.served.find(request.model)
        lora = self.served.lora(request.model)
        chat = isinstance(request, ChatCompletionRequest)
        check_prompt_size(request, self.max_model_len, self.tokenizer.max_chars_per_token)
        tools = tool_mode(request, self.tool_parser) if chat else None
        harmony = chat and self.harmony is not None  # decoded with its markers, special tokens
        if keeps_special_tokens(tools, self.tool_parser) or harmony:
            request.skip_special_tokens = False
        constraint = grammar_of(request, forced_call(request, tools) if chat else None)
        grammar = None if constraint is None else constraint[1]
        prompts = await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, prompts_of, request, self.tokenizer
        )
        prompts = truncated(prompts, request, self.max_model_len)
        think = answer_thinks(request, self.think, prompts[0], self.tokenizer)
        status = self.engine.status
        kv_tokens = status.num_blocks * self.block_size if status and status.num_blocks else None
        limits = (self.max_model_len, self.tokenizer, self.defaults, kv_tokens)
        end = -1 if think is None else think.end
        messages = [engine_request(request, ids, *limits, grammar, end, lora) for ids in prompts]
        n = request.n or 1
        check_logprobs(request, self.max_logprobs)
        beams = beam_search_of(request, self.tokenizer.info.all_eos_token_ids, self.max_logprobs)
        for ids, message in zip(prompts, messages, strict=True):
            check_capacity(self.engine.status, self.block_size, len(ids), message.max_tokens, n)
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        prompt_tokens = sum(map(len, prompts))
        metrics.GATEWAY_PROMPT_TOKENS.inc(prompt_tokens)
        if constraint is not None:
            metrics.CONSTRAINED_REQUESTS.labels(constraint[0]).inc()
        generation = Generation(self.engine, request, prompt_tokens, n)
        generation.constraint_field = None if constraint is None else constraint[0]
        hidden = hidden_token_ids(request, self.tokenizer.info.all_eos_token_ids)
        for p, (ids, message) in enumerate(zip(prompts, messages, strict=True)):
            echo = self.tokenizer.decode(ids) if not chat and request.echo else ""
            choices = [
                Choice(p * n + j, request, self.tokenizer, hidden, arrival) for j in range(n)
            ]
            for choice in choices:
                choice.echo, choice.prompt_ids = echo, ids
                choice.counter = counter_of(think, harmony, self.tokenizer)
            if request.prompt_top is not None:  # the first choice brings them
                choices[0].prompt_logprobs = [None] * len(ids)
            generation.start(message, choices, beams)
        generation.tool_mode = tools
        generation.thinking = None if not chat or self.think is None else think is not None
        generation.counts_reasoning = harmony or (chat and self.think is not None)
        return generation
