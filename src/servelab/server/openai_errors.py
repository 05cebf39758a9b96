"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error has a ``code``: the specific one when there is (``engine_dead``,
``context_length_exceeded``...), else the status's own, so clients can branch on it.
"""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI's error type.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
# HTTP status -> the code of an error that has no more specific one.
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error answered to the client; ``message`` says what was wrong and what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a request-preparation worker process and unpickled in the API process.
        return (APIError, (self.status, self.message), self.__dict__)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code or _CODES.get(status, "server_error" if status >= 500 else "bad_request"),
        }
    }
