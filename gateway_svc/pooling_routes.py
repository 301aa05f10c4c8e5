"""The endpoints whose prompts each come back as one pooled vector (`pooled_requests.py`):
embeddings, vLLM's scores and reranking, and classification."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from turnstile.gateway_svc.classify import Classifications
from turnstile.gateway_svc.embeddings import Embeddings
from turnstile.gateway_svc.pooled_requests import PooledRequests
from turnstile.gateway_svc.scores import Scores

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def pooling_routes(pooled: PooledRequests) -> list[tuple[str, Handler]]:
    """Each POST path and its handler; /score and /rerank under vLLM's older paths too."""
    scores = Scores(pooled)
    return [
        ("/v1/embeddings", Embeddings(pooled).create),
        *[(path, scores.score) for path in ("/score", "/v1/score")],
        *[(path, scores.rerank) for path in ("/rerank", "/v1/rerank", "/v2/rerank")],
        ("/classify", Classifications(pooled).create),
    ]
