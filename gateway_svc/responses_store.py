"""Responses kept in the gateway's memory (`--responses-store-size`): each with its conversation,
so that `previous_response_id` continues it and `GET /v1/responses/{id}` reads it back. The
newest are kept, the oldest forgotten first, so memory stays bounded (vLLM's store keeps every
response for good). Per gateway process: behind several gateways, a conversation's requests go
to the one that stored it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatMessage
from turnstile.gateway_svc.responses_api import ResponsesRequest, add_item


class ResponsesStore:
    def __init__(self, size: int) -> None:
        self.size = size  # 0: none kept, and store / previous_response_id are refused
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[ChatMessage]]] = OrderedDict()

    def keeps(self, asked: ResponsesRequest) -> bool:
        """Whether this request's response will be kept (OpenAI's default: kept)."""
        return self.size > 0 and asked.store is not False

    def history(self, asked: ResponsesRequest) -> list[ChatMessage]:
        """The conversation `asked` continues: its previous response's, or none."""
        for name, value in (("store", asked.store), ("previous_response_id",
                                                     asked.previous_response_id)):  # fmt: skip
            if not self.size and value:
                raise ApiError(400, f"{name} needs a server started with "
                               "--responses-store-size N", code="unsupported_parameter",
                               param=name)  # fmt: skip
        if asked.previous_response_id is None:
            return []
        return list(self._get(asked.previous_response_id, "previous_response_id")[1])

    def keep(self, body: dict[str, Any], turn: list[ChatMessage]) -> None:
        """A finished response, its conversation `turn` followed by its output."""
        conversation = list(turn)
        for i, item in enumerate(body["output"]):
            add_item(conversation, item, f"output[{i}]")
        self._kept[body["id"]] = (body, conversation)
        self._kept.move_to_end(body["id"])
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def body(self, response_id: str) -> dict[str, Any]:
        return self._get(response_id, "response_id")[0]

    def delete(self, response_id: str) -> dict[str, Any]:
        self._get(response_id, "response_id")
        del self._kept[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[ChatMessage]]:
        kept = self._kept.get(response_id)
        if kept is None:
            raise ApiError(404, f"no stored response {response_id!r}", "not_found_error",
                           param=param)  # fmt: skip
        return kept
