"""vLLM's scoring endpoints: `/score` (and `/v1/score`) scores pairs of texts, `/rerank` (and
`/v1/rerank`, `/v2/rerank`: Jina's and Cohere's shape) orders documents by a query. A sequence
classifier of one label reads each pair as one prompt (a cross-encoder: the two texts tokenized
as a pair, or joined where the model says so) and scores it by its activated logit; any other
model embeds each text alone (a bi-encoder) and scores a pair by its vectors' cosine."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated, Any

import msgspec
import numpy as np
from aiohttp import web
from msgspec import Meta

from turnstile.gateway_svc.classify import activated
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import parse_body
from turnstile.gateway_svc.pooled_requests import MAX_INPUTS, PooledRequests
from turnstile.gateway_svc.pooled_truncation import Side, Truncation
from turnstile.gateway_svc.request_ids import answer_id
from turnstile.gateway_svc.request_types import Unused
from turnstile.shared.protocol import LoraRef

Texts = str | list[str]
# The names a /score request may give its two sides, as vLLM's request kinds pair them.
SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
         ("text_1", "text_2"))  # fmt: skip
RESERVED = {"chat_template", "tools", "tokenize", "messages", "add_generation_prompt",
            "continue_final_message"}  # fmt: skip


class ScoringFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    user: Unused = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    truncation_side: Side | None = None  # `pooled_truncation.py`
    use_activation: bool | None = None  # a cross-encoder's: false scores by the bare logit
    # Each query's and document's first k tokens (0: all), cut before the two meet.
    max_tokens_per_query: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    max_tokens_per_doc: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    # A cross-encoder's pair written by --chat-template's template (as messages of roles
    # "query" and "document"): its variables, `instruction` among them (Qwen3-Reranker's).
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self, templated: bool) -> dict[str, Any]:
        """The variables the template writes a pair with; refused where no template does."""
        given = {"instruction": self.instruction} if self.instruction is not None else {}
        given |= self.chat_template_kwargs or {}
        if given and not templated:
            param = "instruction" if self.instruction is not None else "chat_template_kwargs"
            raise ApiError(400, f"{param} is written by a cross-encoder's template, and this "
                           "server has none (--chat-template)", param=param)  # fmt: skip
        if reserved := sorted(RESERVED & given.keys()):
            raise ApiError(400, f"chat_template_kwargs may not set {reserved}",
                           param="chat_template_kwargs")  # fmt: skip
        return given


class ScoreRequest(ScoringFields, forbid_unknown_fields=True, kw_only=True):
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None

    def sides(self) -> tuple[Texts, Texts]:
        given = [(a, b) for a, b in SIDES if None not in (getattr(self, a), getattr(self, b))]
        named = {n for side in SIDES for n in side if getattr(self, n) is not None}
        if len(given) != 1 or named != set(given[0]):
            raise ApiError(400, "give the two sides as queries and documents (or items), "
                           "data_1 and data_2, or text_1 and text_2", param="queries")  # fmt: skip
        first, second = given[0]
        return getattr(self, first), getattr(self, second)


class RerankRequest(ScoringFields, forbid_unknown_fields=True, kw_only=True):
    query: str
    documents: Texts
    top_n: Annotated[int, Meta(ge=0)] = 0  # the best n results; 0: all
    return_documents: bool = True  # Jina's: false leaves each result's document out


class Scores:
    def __init__(self, pooled: PooledRequests) -> None:
        self.pooled = pooled
        self.info = pooled.info
        self.tokenizer = pooled.tokenizer

    async def score(self, http: web.Request) -> web.StreamResponse:
        return await self.pooled.answered(http, "score", partial(self._score, http))

    async def rerank(self, http: web.Request) -> web.StreamResponse:
        return await self.pooled.answered(http, "rerank", partial(self._rerank, http))

    async def _score(self, http: web.Request, usage: dict[str, Any]) -> web.Response:
        request_id = answer_id(http, None)
        request = parse_body(await http.read(), ScoreRequest)
        scores = await self._scores(request, *request.sides(), usage)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        tokens = usage["prompt_tokens"]
        return web.json_response({
            "id": f"score-{request_id}", "object": "list", "created": int(time.time()),
            "model": self.pooled.models.reported(request.model), "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        })  # fmt: skip

    async def _rerank(self, http: web.Request, usage: dict[str, Any]) -> web.Response:
        request_id = answer_id(http, None)
        request = parse_body(await http.read(), RerankRequest)
        documents = _listed(request.documents, "documents")
        scores = await self._scores(request, request.query, documents, usage)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties in order
        kept = order[: request.top_n] if request.top_n else order
        shown = request.return_documents
        results = [{"index": i, "relevance_score": scores[i],
                    "document": {"text": documents[i], "multi_modal": None} if shown else None}
                   for i in kept]  # fmt: skip
        tokens = usage["prompt_tokens"]
        return web.json_response({
            "id": f"score-{request_id}", "model": self.pooled.models.reported(request.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results,
        })  # fmt: skip

    async def _scores(
        self, request: ScoringFields, first: Texts, second: Texts, usage: dict[str, Any]
    ) -> list[float]:
        """Each pair's score: `first`'s one text against every text of `second`, or pair by
        pair."""
        firsts, seconds = _listed(first, "queries"), _listed(second, "documents")
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise ApiError(400, f"{len(firsts)} queries and {len(seconds)} documents: give one "
                           "query, or one for each document", param="queries")  # fmt: skip
        limit = self.pooled.max_model_len
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            if getattr(request, name) >= limit:
                raise ApiError(400, f"{name} must be less than the model's context ({limit})",
                               param=name)  # fmt: skip
        lora = await self.pooled.start(request.model)
        firsts, seconds = await self.pooled.tokenized(
            partial(self._clipped, request, firsts, seconds)
        )
        templated = bool(self.info.labels) and self.tokenizer.given_template
        variables = request.template_kwargs(templated)
        if self.info.labels:
            return await self._cross_encoded(request, firsts, seconds, lora, usage, variables)
        return await self._bi_encoded(request, firsts, seconds, lora, usage)

    def _clipped(
        self, request: ScoringFields, firsts: list[str], seconds: list[str]
    ) -> tuple[list[str], list[str]]:
        """The queries and documents cut to their limits (on a tokenizer thread)."""
        cut = self.tokenizer.clipped
        query, doc = request.max_tokens_per_query, request.max_tokens_per_doc
        return ([cut(t, query) for t in firsts] if query else firsts,
                [cut(t, doc) for t in seconds] if doc else seconds)  # fmt: skip

    async def _cross_encoded(
        self, request: ScoringFields, firsts: list[str], seconds: list[str],
        lora: LoraRef | None, usage: dict[str, Any], variables: dict[str, Any],
    ) -> list[float]:  # fmt: skip
        """A classifier's activated logit of each pair, read as one prompt."""
        if len(self.info.labels) != 1:
            raise ApiError(400, f"the model {self.pooled.models.base!r} has "
                           f"{len(self.info.labels)} labels: a score needs a classifier of one "
                           "(/classify gives each label's)", param="model")  # fmt: skip
        queries = firsts * len(seconds) if len(firsts) == 1 else firsts
        pairs = list(zip(queries, seconds, strict=True))
        cut = self.pooled.truncation(request.truncate_prompt_tokens, request.truncation_side)
        whole = await self.pooled.tokenized(partial(self._pair_prompts, cut, pairs, variables))
        prompts = [ids for ids, _ in whole]
        # where each prompt's type-1 tokens start, where the model types tokens
        types = [second for _, second in whole] if self.info.token_types > 1 else None
        logits = await self.pooled.vectors(prompts, lora, usage, "documents", types)
        return [float(activated(row, self.info, request.use_activation)[0]) for row in logits]

    def _pair_prompts(
        self, cut: Truncation, pairs: list[tuple[str, str]], variables: dict[str, Any]
    ) -> list[tuple[list[int], int]]:
        """Each pair's prompt, truncated as `cut` says: written by --chat-template's template,
        tokenized as a pair (one of an empty second text as its first alone, as transformers),
        or (an LLM reranker's) joined as one text; with where its second text's tokens start
        where the tokenizer types them, else -1."""
        encoded = partial(self.pooled.encoded, cut, param="documents")
        if self.tokenizer.given_template:
            return [(encoded((self._written(a, b, variables),))[0], -1) for a, b in pairs]
        if not self.info.pair_separately:
            return [(encoded((a + b,))[0], -1) for a, b in pairs]
        return [encoded((a, b) if b else (a,)) for a, b in pairs]

    def _written(self, query: str, document: str, variables: dict[str, Any]) -> str:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=False, **variables)
        except ValueError as error:
            raise ApiError(400, str(error), param="chat_template_kwargs") from None

    async def _bi_encoded(
        self, request: ScoringFields, firsts: list[str], seconds: list[str],
        lora: LoraRef | None, usage: dict[str, Any],
    ) -> list[float]:  # fmt: skip
        """The cosine of each pair's embeddings, each text embedded alone."""
        self.pooled.check_pooling()
        texts = firsts + seconds
        cut = self.pooled.truncation(request.truncate_prompt_tokens, request.truncation_side)
        encoded = partial(self.pooled.encoded, cut, param="documents")
        prompts = await self.pooled.tokenized(lambda: [encoded((t,))[0] for t in texts])
        vectors = np.array(await self.pooled.vectors(prompts, lora, usage, "documents"))
        vectors = vectors.astype(np.float64)
        norms = np.linalg.norm(vectors, axis=1)
        queries, documents = vectors[: len(firsts)], vectors[len(firsts) :]
        query_norms, document_norms = norms[: len(firsts)], norms[len(firsts) :]
        dots = (queries * documents).sum(axis=1)  # one query broadcasts against every document
        return (dots / np.maximum(query_norms * document_norms, 1e-8)).tolist()


def _listed(texts: Texts, param: str) -> list[str]:
    listed = [texts] if isinstance(texts, str) else texts
    if not listed:
        raise ApiError(400, f"{param} must hold at least one text", param=param)
    if len(listed) > MAX_INPUTS:
        raise ApiError(400, f"at most {MAX_INPUTS} texts on a side", param=param)
    return listed
