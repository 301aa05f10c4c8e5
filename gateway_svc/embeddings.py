"""OpenAI's `/v1/embeddings`: each input runs as a pooled request (`pooled_requests.py`) whose
last token's final hidden state comes back, cut to `dimensions` and normalized as the model
says (`shared/pooling.py`)."""

from __future__ import annotations

import base64
import time
from functools import partial
from typing import Annotated, Any, Literal

import numpy as np
from aiohttp import web
from msgspec import Meta

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import parse_body
from turnstile.gateway_svc.pooled_requests import InputsRequest, PooledRequests
from turnstile.gateway_svc.request_ids import answer_id


class EmbeddingRequest(InputsRequest, forbid_unknown_fields=True):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None  # Matryoshka models
    use_activation: bool | None = (
        None  # vLLM's: normalized (true) or raw (false); None: the model's
    )


class Embeddings:
    def __init__(self, pooled: PooledRequests) -> None:
        self.pooled = pooled
        self.tokenizer = pooled.tokenizer
        self.models = pooled.models

    async def create(self, http: web.Request) -> web.StreamResponse:
        return await self.pooled.answered(http, "embeddings", partial(self._answer, http))

    async def _answer(self, http: web.Request, usage: dict[str, Any]) -> web.Response:
        """The answer; `usage` counts the prompt tokens as they are known, for the log."""
        request_id = answer_id(http, None)  # the client's X-Request-Id, else a fresh one
        request = parse_body(await http.read(), EmbeddingRequest)
        lora = await self.pooled.start(request.model)
        info = self.tokenizer.info
        if info.labels:
            raise ApiError(400, f"the model {self.models.base!r} is a sequence classifier: it "
                           "answers /classify, /score and /rerank, not embeddings",
                           param="model")  # fmt: skip
        self.pooled.check_pooling()
        width = self._width(request.dimensions)
        prompts = await self.pooled.tokenized(partial(self.pooled.prompts, request))
        vectors = await self.pooled.vectors(prompts, lora, usage, request.param)
        data = [
            {"object": "embedding", "index": i,
             "embedding": self._encoded(vector[:width], request)}
            for i, vector in enumerate(vectors)
        ]  # fmt: skip
        tokens = usage["prompt_tokens"]
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

    def _encoded(self, vector: np.ndarray, request: EmbeddingRequest) -> Any:
        """The vector normalized where the model (or `use_activation`) says, as floats or
        base64 float32."""
        normalized = request.use_activation
        if normalized is None:
            normalized = self.tokenizer.info.normalize_embeddings
        if normalized:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize
        if request.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()
