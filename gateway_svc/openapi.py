"""The gateway's OpenAPI document, with request schemas generated from the same msgspec
Structs that validate the requests, so the two cannot drift apart."""

from __future__ import annotations

from typing import Any

import msgspec

from turnstile.gateway_svc.openai_api import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
            },
        }
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(status): {"description": "error", "content": body} for status in statuses}


def _generation(schema: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "a completion, or a stream of Server-Sent Events",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 413, 429, 503),
            },
        }
    }


def openapi_document(model_name: str, max_model_len: int) -> dict[str, Any]:
    _, schemas = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template="#/components/schemas/{name}"
    )
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        # Any other model name is a 404, as with OpenAI.
        properties = schemas[request]["properties"]
        properties["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}], "default": None}
        # Prompt and completion share the context: more than it holds is always refused.
        for name in ("max_tokens", "max_completion_tokens"):
            if name in properties:
                properties[name]["anyOf"][0]["maximum"] = max_model_len - 1
    return {
        "openapi": "3.1.0",
        "info": {"title": f"Turnstile ({model_name})", "version": "1"},
        "paths": {
            "/v1/completions": _generation("CompletionRequest", "Complete a prompt"),
            "/v1/chat/completions": _generation("ChatCompletionRequest", "Answer a chat"),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "responses": {
                        "200": {
                            "description": "model list",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Ready to serve?",
                    "responses": {
                        "200": {
                            "description": "ready",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors(503),
                    },
                }
            },
        },
        "components": {"schemas": {**schemas, "Error": _ERROR}},
    }
