"""OpenAI's `/v1/embeddings`: each input runs as a request whose prompt is computed and whose
last token's hidden state comes back (`SamplingParams.embed`; the one token it samples is
dropped), cut to `dimensions` and normalized as the model says (`shared/pooling.py`). A
request's inputs run together, batched with everything else, and share the prefix cache."""

from __future__ import annotations

import asyncio
import base64
import time
from concurrent.futures import Executor
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from aiohttp import web
from msgspec import Meta

from turnstile.gateway_svc import metrics
from turnstile.gateway_svc.engine_client import End, EngineClient, RequestStream
from turnstile.gateway_svc.errors import REFUSALS, ApiError, refusal
from turnstile.gateway_svc.openai_api import parse_body, truncated
from turnstile.gateway_svc.request_ids import answer_id, answered
from turnstile.gateway_svc.request_types import Unused
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.shared.protocol import AddRequest, Embedding, LoraRef, SamplingParams, pack_ids
from turnstile.shared.tokenizer import Tokenizer

MAX_INPUTS = 2048  # in one request, as OpenAI's limit
EMBED = SamplingParams(embed=True)


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: str | Annotated[list[int | str | list[int]], Meta(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None  # Matryoshka models
    user: Unused = None
    # vLLM's: each input's last k tokens (-1: the context's length); the tokenizer's own
    # special tokens around each text (Llama's BOS, Qwen3-Embedding's closing EOS).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or token ids."""
        given = self.input
        if isinstance(given, str) or isinstance(given[0], int):
            return [given]  # type: ignore[list-item]
        if len({type(item) for item in given}) > 1:
            raise ApiError(400, "input must be a string, a list of token ids, or a list of "
                           "either", param="input")  # fmt: skip
        if len(given) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs in one request", param="input")
        return given  # type: ignore[return-value]


class Embeddings:
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
        self.max_model_len = max_model_len
        self.models = models
        self.tokenizing = tokenizing  # the gateway's tokenizer threads
        self.log_requests = log_requests  # a line each request as it ends

    async def create(self, http: web.Request) -> web.StreamResponse:
        usage = {"prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
        return await answered(
            http, "embeddings", time.perf_counter(), self._answer(http, usage),
            lambda: usage | {"completion_tokens": 0}, self.log_requests,
        )  # fmt: skip

    async def _answer(self, http: web.Request, usage: dict[str, Any]) -> web.Response:
        """The answer; `usage` counts the prompt tokens as they are known, for the log."""
        request_id = answer_id(http, None)  # the client's X-Request-Id, else a fresh one
        request = parse_body(await http.read(), EmbeddingRequest)
        await self.models.find(request.model)
        lora = self.models.lora(request.model)
        info = self.tokenizer.info
        if info.pooling != "last":
            raise ApiError(400, f"this model's embeddings are pooled by {info.pooling!r}; "
                           "Turnstile computes last-token pooling only", param="model")  # fmt: skip
        width = self._width(request.dimensions)
        prompts = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, self._tokenize, request
        )
        prompts = truncated(prompts, request, self.max_model_len)  # type: ignore[arg-type]
        for i, ids in enumerate(prompts):
            if not 0 < len(ids) < self.max_model_len:
                raise ApiError(400, f"input {i} has {len(ids)} tokens: an input takes 1 to "
                               f"{self.max_model_len - 1} (the model's context is "
                               f"{self.max_model_len})", code="context_length_exceeded",
                               param="input")  # fmt: skip
        if not self.engine.ready:
            raise ApiError(503, "no executor is ready", "service_unavailable")
        tokens = usage["prompt_tokens"] = sum(map(len, prompts))
        metrics.GATEWAY_PROMPT_TOKENS.inc(tokens)
        streams = [self.engine.submit(_embedding_request(ids, lora)) for ids in prompts]
        try:
            vectors = []
            for stream in streams:
                vector, cached = await self._vector(stream)
                vectors.append(vector)
                usage["prompt_tokens_details"]["cached_tokens"] += cached
        finally:
            for stream in streams:  # a no-op for those that ended; the rest, the client left
                self.engine.abort(stream)
        data = [
            {"object": "embedding", "index": i,
             "embedding": self._encoded(vector[:width], request.encoding_format)}
            for i, vector in enumerate(vectors)
        ]  # fmt: skip
        return web.json_response({
            "id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
            "model": self.models.reported(request.model), "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })  # fmt: skip

    def _width(self, dimensions: int | None) -> int:
        """The vector's width: the model's, or `dimensions` where the model allows cutting."""
        info = self.tokenizer.info
        if dimensions is None:
            return info.hidden_size
        if not info.is_matryoshka:
            raise ApiError(400, f"the model {self.models.base!r} does not support Matryoshka "
                           "representation: its embeddings cannot be cut to other dimensions",
                           param="dimensions")  # fmt: skip
        listed = info.matryoshka_dimensions
        if (listed and dimensions not in listed) or dimensions > info.hidden_size:
            allowed = list(listed) if listed else f"1 to {info.hidden_size}"
            raise ApiError(400, f"the model {self.models.base!r} supports dimensions {allowed}",
                           param="dimensions")  # fmt: skip
        return dimensions

    def _tokenize(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids (on a tokenizer thread)."""
        vocab, chars = self.tokenizer.vocab_size, self.tokenizer.max_chars_per_token
        prompts = []
        for given in request.inputs():
            if isinstance(given, str):
                if len(given) > self.max_model_len * chars:
                    raise ApiError(400, f"an input has {len(given)} characters: more than this "
                                   f"model's context of {self.max_model_len} tokens can hold",
                                   code="context_length_exceeded", param="input")  # fmt: skip
                prompts.append(self.tokenizer.encode(given, request.add_special_tokens))
            elif any(not 0 <= t < vocab for t in given):
                raise ApiError(400, f"input token ids must lie in [0, {vocab})", param="input")
            else:
                prompts.append(list(given))
        return prompts

    async def _vector(self, stream: RequestStream) -> tuple[np.ndarray, int]:
        """The input's hidden state, once its request ends, and its tokens found cached."""
        vector = None
        while not isinstance(event := await stream.events.get(), End):
            if isinstance(event, Embedding):
                vector = np.frombuffer(event.vector, dtype="<f4")
        if event.reason in REFUSALS:
            raise refusal(event.reason, event.error)
        if vector is None or len(vector) != self.tokenizer.info.hidden_size:
            raise ApiError(500, "the executor answered no embedding", "server_error")
        return vector, event.cached_tokens

    def _encoded(self, vector: np.ndarray, encoding: str) -> Any:
        """The vector normalized where the model normalizes, as floats or base64 float32."""
        if self.tokenizer.info.normalize_embeddings:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize
        if encoding == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()


def _embedding_request(ids: list[int], lora: LoraRef | None) -> AddRequest:
    """One input for the scheduler: its prompt computed (with the adapter `lora`), one token
    sampled and dropped."""
    return AddRequest(req_id=0, prompt_ids=pack_ids(ids), max_tokens=1, sampling=EMBED,
                      ignore_eos=True, lora=lora)  # fmt: skip
