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


# How a scheduler's refusal ("error", "grammar", ... : `Finished.reason`) reaches the client:
# status, OpenAI error type, headers.
REFUSALS = {
    "error": (400, "invalid_request_error", {}),
    "grammar": (400, "invalid_request_error", {}),
    "adapter": (400, "invalid_request_error", {}),  # its LoRA adapter does not load
    "overloaded": (429, "rate_limit_exceeded", {"Retry-After": "1"}),
    "unavailable": (503, "service_unavailable", {"Retry-After": "5"}),
    "timeout": (504, "timeout", {}),
    "failed": (500, "server_error", {}),
}


def refusal(reason: str, message: str, param: str | None = None) -> ApiError:
    """The client's error for a request the scheduler refused or could not end (REFUSALS)."""
    status, kind, headers = REFUSALS[reason]
    param = param or ("model" if reason == "adapter" else None)
    return ApiError(status, message, kind, headers=dict(headers), param=param)
