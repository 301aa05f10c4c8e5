"""The one error a request can end in before it runs: an HTTP status with an OpenAI error body."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str = "",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code or kind
        self.headers = headers or {}
        self.param = param  # the request field at fault, as OpenAI names it

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "code": self.code}
        return {"error": error | {"param": self.param}}
