"""Every error the HTTP server answers, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Used by the routes (``api``), the ASGI guard in front of them (``http_guard``) and the HTTP/1.1 protocol
below both (``http_protocol``), so even a malformed request line gets JSON, never ``text/plain``.
Messages are capped (``--max-error-message-chars``): an error never echoes a client's megabytes back.

Every error carries ``x-should-retry`` (the header the official OpenAI SDKs obey before their own rule, which
retries every 408, 409, 429 and 5xx): ``true`` only for a state that passes by itself (``RETRYABLE_CODES``: the
engine starting, restarting or stalled, the server draining, the queue full, a slow client cut off), ``false``
for everything else, where the same request would fail again or repeat work already lost (a 400, 413 or 415,
a 504 after ``--request-timeout``, a 500 the engine raised, an engine that died).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from omni_server.protocol import ErrorKind, RequestError

if TYPE_CHECKING:
    from starlette.responses import Response

# kind -> (HTTP status, OpenAI error type, default code)
ERROR_STATUS: dict[ErrorKind, tuple[int, str, str]] = {
    "invalid_request": (400, "invalid_request_error", "invalid_value"),
    "capacity": (400, "invalid_request_error", "kv_capacity_exceeded"),
    "engine": (500, "server_error", "engine_error"),
    "aborted": (500, "server_error", "aborted"),
    "unavailable": (503, "service_unavailable", "engine_unavailable"),
    "timeout": (504, "timeout_error", "request_timeout"),
}
DEFAULT_MAX_MESSAGE_CHARS = 2000
RETRYABLE_CODES = frozenset(
    {
        "engine_starting",
        "engine_restarting",
        "engine_stalled",
        "server_shutting_down",
        "queue_full",
        "header_timeout",
        "body_timeout",
    }
)


class APIError(Exception):
    """An error answered in the OpenAI shape; ``headers`` go on the response (``Retry-After``, ...; always
    ``x-should-retry``, from ``code``); ``close`` ends the connection after it (the request's body was not read)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {"x-should-retry": "true" if code in RETRYABLE_CODES else "false", **(headers or {})}
        self.close = close

    @classmethod
    def from_request_error(cls, error: RequestError) -> APIError:
        status, kind, code = ERROR_STATUS[error.kind]
        return cls(status, error.message, type=kind, param=error.param, code=error.code or code)


def invalid_field(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def cap_message(message: str, max_chars: int = DEFAULT_MAX_MESSAGE_CHARS) -> str:
    if len(message) <= max_chars:
        return message
    omitted = len(message) - max_chars
    return f"{message[:max_chars]}... ({omitted} more characters omitted)"


def error_body(error: APIError, max_chars: int = DEFAULT_MAX_MESSAGE_CHARS) -> bytes:
    detail = {
        "message": cap_message(error.message, max_chars),
        "type": error.type,
        "param": error.param,
        "code": error.code,
    }
    return json.dumps({"error": detail}).encode()


def error_headers(error: APIError, body: bytes) -> list[tuple[bytes, bytes]]:
    """Raw ASGI/h11 headers of an error response."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    if error.close:
        headers.append((b"connection", b"close"))
    return headers


def error_response(error: APIError, max_chars: int = DEFAULT_MAX_MESSAGE_CHARS) -> Response:
    """The error as a Starlette ``Response`` (the routes' exception handlers)."""
    from starlette.responses import Response

    body = error_body(error, max_chars)
    response = Response(content=body, status_code=error.status, media_type="application/json")
    for name, value in error_headers(error, body):
        if name not in (b"content-type", b"content-length"):
            response.headers.append(name.decode("latin-1"), value.decode("latin-1"))
    return response
