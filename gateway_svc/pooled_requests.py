"""Prompts run for one vector each, the path /v1/embeddings, /score, /rerank and /classify share:
each prompt a request computed to its end, whose last token comes back pooled
(`SamplingParams.embed`: its final hidden state, or a classifier's labels' logits; the one
token sampled is dropped). A request's prompts run together, batched with everything else, and
share the prefix cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
from aiohttp import web
from msgspec import Meta

from turnstile.gateway_svc import metrics
from turnstile.gateway_svc.engine_client import End, EngineClient, RequestStream
from turnstile.gateway_svc.errors import REFUSALS, ApiError, refusal
from turnstile.gateway_svc.openai_api import chat_text
from turnstile.gateway_svc.pooled_truncation import Side, Truncation
from turnstile.gateway_svc.request_ids import answered
from turnstile.gateway_svc.request_types import ChatMessage, Unused
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.gateway_svc.token_requests import TokenizeChat
from turnstile.shared.protocol import AddRequest, Embedding, LoraRef, SamplingParams, pack_ids
from turnstile.shared.tokenizer import Tokenizer

POOLED = SamplingParams(embed=True)
MAX_INPUTS = 2048  # in one request, as OpenAI's limit
T = TypeVar("T")


class InputsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """/v1/embeddings' and /classify's fields: texts or token ids, each a prompt; or, as vLLM's,
    `messages`: a conversation (or a list of them), each a prompt as the chat template writes
    it."""

    input: str | Annotated[list[int | str | list[int]], Meta(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage | list[ChatMessage]], Meta(min_length=1)] | None = None
    model: str | None = None
    user: Unused = None
    # vLLM's: each input cut to k tokens (-1: the context's length; `pooled_truncation.py`);
    # the tokenizer's own special tokens around each text (Llama's BOS, Qwen3-Embedding's
    # closing EOS; not given: a text's yes, a conversation's no: its template writes them).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    truncation_side: Side | None = None  # `pooled_truncation.py`
    add_special_tokens: bool | None = None
    # vLLM's chat options, as a chat completion's; a conversation is not answered by default.
    # None: not given (beside input, where nothing is templated, they are refused).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or token ids."""
        given = self.input
        if given is None or self.messages is not None:
            raise ApiError(400, "give either input or messages", param="input")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name} applies to messages; input is not templated",
                               param=name)  # fmt: skip
        if isinstance(given, str) or isinstance(given[0], int):
            return [given]  # type: ignore[list-item]
        if len({type(item) for item in given}) > 1:
            raise ApiError(400, "input must be a string, a list of token ids, or a list of "
                           "either", param="input")  # fmt: skip
        if len(given) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs in one request", param="input")
        return given  # type: ignore[return-value]

    @property
    def param(self) -> str:
        """The field the prompts came from, for an error about them."""
        return "input" if self.messages is None else "messages"

    def conversations(self) -> list[TokenizeChat]:
        """Each conversation of `messages`, with the chat options, as a chat prompt."""
        given = self.messages or []
        single = all(isinstance(item, ChatMessage) for item in given)
        if not single and not all(isinstance(item, list) and item for item in given):
            raise ApiError(400, "messages must be a conversation (a list of messages) or a list "
                           "of conversations", param="messages")  # fmt: skip
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", param="continue_final_message")  # fmt: skip
        if len(given) > MAX_INPUTS and not single:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs in one request", param="messages")
        return [
            TokenizeChat(messages=conversation,
                         add_generation_prompt=bool(self.add_generation_prompt),
                         continue_final_message=bool(self.continue_final_message),
                         chat_template_kwargs=self.chat_template_kwargs)
            for conversation in ([given] if single else given)
        ]  # fmt: skip


class PooledRequests:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        max_model_len: int,
        models: ServedModels,
        tokenizing: Executor,
        log_requests: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = tokenizer.info
        self.max_model_len = max_model_len
        self.models = models
        self.tokenizing = tokenizing  # the gateway's tokenizer threads
        self.log_requests = log_requests  # a line each request as it ends

    async def answered(
        self, http: web.Request, endpoint: str,
        answer: Callable[[dict[str, Any]], Awaitable[web.Response]],
    ) -> web.StreamResponse:  # fmt: skip
        """`answer(usage)`, counted and logged with the prompt tokens it counts in `usage`."""
        usage = {"prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
        return await answered(
            http, endpoint, time.perf_counter(), answer(usage),
            lambda: usage | {"completion_tokens": 0}, self.log_requests,
        )  # fmt: skip

    async def start(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter `model` names (loaded where a resolver finds it), None: the base;
        refused where the server runs --runner generate."""
        if self.info.runner == "generate":
            raise ApiError(400, f"the model {self.models.base!r} is served with --runner "
                           "generate: it answers no embeddings, scores or classes",
                           param="model")  # fmt: skip
        await self.models.find(model)
        return self.models.lora(model)

    def check_pooling(self) -> None:
        """Refuses embeddings pooled otherwise than the executor pools them: a decoder's last
        token (an encoder's pooling was checked at start)."""
        if not self.info.encoder_only and self.info.pooling != "last":
            raise ApiError(400, f"this model's embeddings are pooled by {self.info.pooling!r}; "
                           "Turnstile computes a decoder's last-token pooling only",
                           param="model")  # fmt: skip

    async def tokenized(self, work: Callable[[], T]) -> T:
        """`work()` on a tokenizer thread: a long text must not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work)

    def encoded(
        self, cut: Truncation, texts: tuple[str, ...], param: str, add_special_tokens: bool = True
    ) -> tuple[list[int], int]:
        """A text's (or a pair's) token ids as `cut` truncates them, and where its tokens typed 1
        start (-1: none); where nothing is cut, one too long for the context is refused before
        it is tokenized."""
        if cut.keep is None:
            self.fits("".join(texts), param)
        return cut.texts(self.tokenizer, texts, add_special_tokens)

    def fits(self, text: str, param: str) -> None:
        """Refuses a text too long for the context, whatever it tokenizes to."""
        if len(text) > self.max_model_len * self.tokenizer.max_chars_per_token:
            raise ApiError(400, f"a text has {len(text)} characters: more than this model's "
                           f"context of {self.max_model_len} tokens can hold",
                           code="context_length_exceeded", param=param)  # fmt: skip

    def truncation(self, keep: int | None, side: Side | None) -> Truncation:
        return Truncation.of(keep, side, self.max_model_len)

    def prompts(self, request: InputsRequest) -> list[list[int]]:
        """Each input's token ids, or each conversation's, truncated as the request asks (on a
        tokenizer thread)."""
        vocab = self.tokenizer.vocab_size
        cut = self.truncation(request.truncate_prompt_tokens, request.truncation_side)
        if request.messages is not None and request.input is None:
            special = bool(request.add_special_tokens)
            texts = [chat_text(chat, self.tokenizer) for chat in request.conversations()]
            return [self.encoded(cut, (text,), "messages", special)[0] for text in texts]
        prompts = []
        special = request.add_special_tokens is not False
        for given in request.inputs():
            if isinstance(given, str):
                prompts.append(self.encoded(cut, (given,), "input", special)[0])
            elif any(not 0 <= t < vocab for t in given):
                raise ApiError(400, f"input token ids must lie in [0, {vocab})", param="input")
            else:
                prompts.append(cut.ids(list(given)))
        return prompts

    async def vectors(
        self, prompts: list[list[int]], lora: LoraRef | None, usage: dict[str, Any], param: str,
        seconds: list[int] | None = None,
    ) -> list[np.ndarray]:  # fmt: skip
        """Each prompt's pooled vector (`info.pooled_size` floats); `usage` counts the prompt
        tokens and those found cached. `seconds`: where each prompt's second text starts, an
        encoder's pairs' (`SamplingParams.second_text`)."""
        for i, ids in enumerate(prompts):
            if not 0 < len(ids) <= self.max_model_len:
                raise ApiError(400, f"input {i} has {len(ids)} tokens: an input takes 1 to "
                               f"{self.max_model_len} (the model's context)",
                               code="context_length_exceeded", param=param)  # fmt: skip
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        usage["prompt_tokens"] = sum(map(len, prompts))
        metrics.GATEWAY_PROMPT_TOKENS.inc(usage["prompt_tokens"])
        seconds = seconds or [-1] * len(prompts)
        streams = [
            self.engine.submit(_pooled_request(ids, lora, second))
            for ids, second in zip(prompts, seconds, strict=True)
        ]
        try:
            vectors = []
            for stream in streams:
                vector, cached = await self._vector(stream)
                vectors.append(vector)
                usage["prompt_tokens_details"]["cached_tokens"] += cached
            return vectors
        finally:
            for stream in streams:  # a no-op for those that ended; the rest, the client left
                self.engine.abort(stream)

    async def _vector(self, stream: RequestStream) -> tuple[np.ndarray, int]:
        """The prompt's pooled vector, once its request ends, and its tokens found cached."""
        vector = None
        while not isinstance(event := await stream.events.get(), End):
            if isinstance(event, Embedding):
                vector = np.frombuffer(event.vector, dtype="<f4")
        if event.reason in REFUSALS:
            raise refusal(event.reason, event.error)
        if vector is None or len(vector) != self.info.pooled_size:
            raise ApiError(500, "the executor answered no pooled vector", "server_error")
        return vector, event.cached_tokens


def _pooled_request(ids: list[int], lora: LoraRef | None, second: int) -> AddRequest:
    """One prompt for the scheduler: computed (with the adapter `lora`), one token sampled and
    dropped."""
    sampling = POOLED if second < 0 else SamplingParams(embed=True, second_text=second)
    return AddRequest(req_id=0, prompt_ids=pack_ids(ids), max_tokens=1, sampling=sampling,
                      ignore_eos=True, lora=lora)  # fmt: skip
