"""The gateway's OpenAPI document, with request schemas generated from the same msgspec
Structs that validate the requests, so the two cannot drift apart."""

from __future__ import annotations

from typing import Any

import msgspec

from turnstile.gateway_svc.classify import ClassificationRequest
from turnstile.gateway_svc.embeddings import EmbeddingRequest
from turnstile.gateway_svc.messages_api import MessagesCount, MessagesRequest
from turnstile.gateway_svc.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
)
from turnstile.gateway_svc.responses_api import ResponsesRequest
from turnstile.gateway_svc.scores import RerankRequest, ScoreRequest
from turnstile.gateway_svc.token_requests import Detokenize, TokenizeChat, TokenizeCompletion

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code", "param"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(status): {"description": "error", "content": body} for status in statuses}


def _post(schemas: list[str], summary: str, answer: str, stream: bool = False) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{schema}"} for schema in schemas]
    content = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}
                },
            },
            "responses": {
                "200": {"description": answer, "content": content},
                **_errors(400, 401, 404, 413, 429, 503),
            },
        }
    }


def _get(summary: str, answer: str, *errors: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"type": "object"}}}
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": answer, "content": content}, **_errors(*errors)},
        }
    }


def _stored() -> dict[str, Any]:
    """GET and DELETE of a stored response (404 where none is kept under the id)."""
    where = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    content = {"application/json": {"schema": {"type": "object"}}}
    return {
        method: {"summary": summary, "parameters": where,
                 "responses": {"200": {"description": answer, "content": content},
                               **_errors(401, 404)}}
        for method, summary, answer in (("get", "A stored response", "the response"),
                                        ("delete", "Forget a stored response", "deleted"))
    }  # fmt: skip


def openapi_document(served_names: list[str], max_model_len: int) -> dict[str, Any]:
    requests = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, MessagesRequest,
                MessagesCount, EmbeddingRequest, ScoreRequest, RerankRequest,
                ClassificationRequest, TokenizeCompletion, TokenizeChat, Detokenize]  # fmt: skip
    _, schemas = msgspec.json.schema_components(
        requests, ref_template="#/components/schemas/{name}"
    )
    for request in requests:
        # Any other model name is a 404, as with OpenAI.
        properties = schemas[request.__name__]["properties"]
        names = [{"const": name} for name in served_names]
        properties["model"] = {"anyOf": [*names, {"type": "null"}], "default": None}
        # Prompt and completion share the context: more than it holds is always refused.
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if name in properties:
                count = properties[name].get("anyOf", [properties[name]])[0]
                count["maximum"] = max_model_len - 1
    answer = "a completion, or a stream of Server-Sent Events"
    return {
        "openapi": "3.1.0",
        "info": {"title": f"Turnstile ({served_names[0]})", "version": "1"},
        "paths": {
            "/v1/completions": _post(["CompletionRequest"], "Complete prompts", answer, True),
            "/v1/chat/completions": _post(["ChatCompletionRequest"], "Answer a chat", answer, True),
            "/v1/responses": _post(
                ["ResponsesRequest"],
                "Answer input",
                "a response, or a stream of its events",
                True,
            ),
            "/v1/responses/{response_id}": _stored(),
            "/v1/messages": _post(
                ["MessagesRequest"],
                "Answer messages (Anthropic's API)",
                "a message, or a stream of its events",
                True,
            ),
            "/v1/messages/count_tokens": _post(
                ["MessagesCount"], "Count a message request's input tokens", "input_tokens"
            ),
            "/v1/embeddings": _post(
                ["EmbeddingRequest"], "Embed inputs", "an embedding of each input"
            ),
            **{
                path: _post(["ScoreRequest"], "Score pairs of texts", "a score each pair")
                for path in ("/score", "/v1/score")
            },
            **{
                path: _post(["RerankRequest"], "Order documents by a query", "the best first")
                for path in ("/rerank", "/v1/rerank", "/v2/rerank")
            },
            "/classify": _post(
                ["ClassificationRequest"], "Classify inputs", "each input's label and probs"
            ),
            "/v1/models": _get("The served model", "model list", 401),
            "/tokenize": _post(
                ["TokenizeCompletion", "TokenizeChat"],
                "Token ids of a prompt or a chat",
                "count, max_model_len, tokens",
            ),
            "/detokenize": _post(["Detokenize"], "Text of token ids", "prompt"),
            "/version": _get("The server's version", "version"),
            "/server_info": _get(  # SGLang's, for sglang-router; also as /get_server_info
                "The served model's name", "served_model_name, max_model_len, version"
            ),
            "/health": _get("Ready to serve?", "ready", 503),
            "/ping": _get("Ready to serve? (SageMaker's probe, as vLLM's)", "ready", 503)
            | {"post": _get("Ready to serve? (SageMaker's probe)", "ready", 503)["get"]},
        },
        "components": {"schemas": {**schemas, "Error": _ERROR}},
    }
