"""vLLM's `/classify`: a sequence classifier's labels for each input (`pooled_requests.py`), its
logits activated as the model says (a sigmoid of one label, a softmax of several, or none)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
from aiohttp import web

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import parse_body
from turnstile.gateway_svc.pooled_requests import InputsRequest, PooledRequests
from turnstile.gateway_svc.request_ids import answer_id
from turnstile.shared.model_info import ModelInfo


class ClassificationRequest(InputsRequest, forbid_unknown_fields=True):
    use_activation: bool | None = None  # vLLM's: None or true, the model's activation


def activated(logits: np.ndarray, info: ModelInfo, use_activation: bool | None) -> np.ndarray:
    """A classifier's logits through its activation, unless `use_activation` is false."""
    if use_activation is False or info.classifier_activation == "none":
        return logits
    if info.classifier_activation == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    exp = np.exp(logits - logits.max())
    return exp / exp.sum()


def refuse_unless_classifier(info: ModelInfo, model: str, endpoint: str) -> None:
    if not info.labels:
        raise ApiError(400, f"the model {model!r} is not a sequence classifier: {endpoint} needs "
                       "one (a *ForSequenceClassification checkpoint)", param="model")  # fmt: skip


def check_generates(info: ModelInfo, model: str) -> None:
    """A generation request's check: a sequence classifier, an encoder, or a server that runs
    --runner pooling, generates nothing."""
    if info.labels:
        raise ApiError(400, f"the model {model!r} is a sequence classifier: it answers /classify, "
                       "/score and /rerank, and generates nothing", param="model")  # fmt: skip
    if info.encoder_only:
        raise ApiError(400, f"the model {model!r} is an encoder: it answers embeddings, /score "
                       "and /rerank, and generates nothing", param="model")  # fmt: skip
    if info.runner == "pooling":
        raise ApiError(400, f"the model {model!r} is served with --runner pooling: it answers "
                       "embeddings, /score, /rerank and /classify, and generates nothing",
                       param="model")  # fmt: skip


class Classifications:
    def __init__(self, pooled: PooledRequests) -> None:
        self.pooled = pooled

    async def create(self, http: web.Request) -> web.StreamResponse:
        return await self.pooled.answered(http, "classify", partial(self._answer, http))

    async def _answer(self, http: web.Request, usage: dict[str, Any]) -> web.Response:
        request_id = answer_id(http, None)
        request = parse_body(await http.read(), ClassificationRequest)
        lora = await self.pooled.start(request.model)
        info, models = self.pooled.info, self.pooled.models
        refuse_unless_classifier(info, models.base, "/classify")
        prompts = await self.pooled.tokenized(partial(self.pooled.prompts, request))
        logits = await self.pooled.vectors(prompts, lora, usage, request.param)
        data = []
        for i, row in enumerate(logits):
            probs = activated(row.astype(np.float64), info, request.use_activation)
            data.append({"index": i, "label": info.labels[int(np.argmax(probs))],
                         "probs": probs.tolist(), "num_classes": len(probs)})  # fmt: skip
        tokens = usage["prompt_tokens"]
        return web.json_response({
            "id": f"classify-{request_id}", "object": "list", "created": int(time.time()),
            "model": models.reported(request.model), "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        })  # fmt: skip
