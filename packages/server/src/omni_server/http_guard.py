"""The ASGI guard in front of the routes: what every request must satisfy before any route sees it.

In order, each failure answered in the OpenAI error shape and changing nothing:
- at most ``max_header_count`` headers of at most ``max_header_bytes`` in all (431; a head that never completes
  is bounded below, by h11 in ``http_protocol``);
- a ``Host`` header the server answers to (400 ``invalid_host``): ``allowed_hosts``, by default the loopback
  names when the server is bound to a loopback address (DNS-rebinding protection), any host otherwise;
- while the server drains, every route but ``/health`` and ``/metrics`` answers 503 ``server_shutting_down``;
- ``Authorization: Bearer <api_key>`` on ``/v1/*`` when ``api_key`` is set (401 ``invalid_api_key``);
- a body of at most ``max_request_body_bytes`` (413; a larger ``Content-Length`` is refused unread), sent as
  JSON (``Content-Type: application/json``, else 415), completely within ``body_timeout_s`` (408). The body
  is read here, so a route never waits on a slow client, and then replayed to the route.
Rejections that leave unread body bytes close the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Callable

from omni_server.config import ServerConfig
from omni_server.errors import APIError, error_body, error_headers

ASGIApp = Callable  # (scope, receive, send) -> awaitable
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
_ALWAYS_OPEN = ("/health", "/metrics")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_names(config: ServerConfig) -> frozenset[str] | None:
    """Host names (without port) the server answers to; None means any."""
    if config.allowed_hosts is not None:
        names = frozenset(name.lower().strip("[]") for name in config.allowed_hosts)
        return None if "*" in names else names
    return frozenset(LOOPBACK_HOST_NAMES) if is_loopback(config.host) else None


def host_name(header: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"example.com:80"`` -> ``"example.com"``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HTTPGuard:
    def __init__(self, app: ASGIApp, config: ServerConfig, *, draining: Callable[[], bool]) -> None:
        self._app = app
        self._config = config
        self._draining = draining
        self._hosts = allowed_host_names(config)
        self._api_key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        try:
            receive = await self._check(scope, receive)
        except APIError as error:
            await self._reject(send, error)
            return
        if receive is None:  # the client went away while sending its body
            return
        await self._app(scope, receive, send)

    async def _check(self, scope: dict, receive: Callable) -> Callable | None:
        config, headers = self._config, scope["headers"]
        if len(headers) > config.max_header_count:
            raise APIError(431, f"too many headers: {len(headers)}; at most {config.max_header_count} are accepted",
                           type="invalid_request_error", code="too_many_headers", close=True)
        head_bytes = sum(len(name) + len(value) + 4 for name, value in headers)
        if head_bytes > config.max_header_bytes:
            raise APIError(431, f"the request headers have {head_bytes} bytes; at most {config.max_header_bytes} are "
                           "accepted (--max-header-bytes)", type="invalid_request_error", code="headers_too_large",
                           close=True)
        values: dict[bytes, bytes] = {}
        for name, value in headers:
            values.setdefault(name, value)
        if self._hosts is not None:
            host = host_name(values.get(b"host", b"").decode("latin-1"))
            if host not in self._hosts:
                raise APIError(400, f"this server does not answer to Host {host[:100]!r}; allowed: "
                               f"{', '.join(sorted(self._hosts))} (see --allowed-hosts)",
                               type="invalid_request_error", param="Host", code="invalid_host", close=True)
        path = scope["path"]
        if self._draining() and path not in _ALWAYS_OPEN:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           type="service_unavailable", code="server_shutting_down",
                           headers={"Retry-After": "5"}, close=True)
        if self._api_key is not None and path.startswith("/v1/") and scope["method"] != "OPTIONS":
            supplied = values.get(b"authorization", b"")
            if not hmac.compare_digest(supplied, b"Bearer " + self._api_key):
                raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <api key>'",
                               type="invalid_request_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}, close=True)
        return await self._read_body(scope, values, receive)

    async def _read_body(self, scope: dict, values: dict[bytes, bytes], receive: Callable) -> Callable | None:
        limit = self._config.max_request_body_bytes
        length_header = values.get(b"content-length")
        chunked = b"chunked" in values.get(b"transfer-encoding", b"").lower()
        if length_header is None and not chunked:
            return receive  # no body
        if length_header is not None:
            try:
                length = int(length_header)
            except ValueError:
                length = -1
            if length < 0:
                raise APIError(400, "Content-Length must be a non-negative integer", type="invalid_request_error",
                               code="invalid_content_length", close=True)
            if length > limit:
                raise APIError(413, f"the request body has {length} bytes; at most {limit} are accepted "
                               "(--max-request-body-bytes)", type="invalid_request_error", code="body_too_large",
                               close=True)
            if length == 0:
                return receive
        body = bytearray()
        deadline = time.monotonic() + self._config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self._config.body_timeout_s:g} s",
                               type="invalid_request_error", code="body_timeout", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes (--max-request-body-bytes)",
                               type="invalid_request_error", code="body_too_large", close=True)
            if not message.get("more_body", False):
                break
        content_type = values.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if body and not (content_type == b"application/json" or content_type.endswith(b"+json")):
            shown = content_type.decode("latin-1")[:100] or "none"
            raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                           f"(got Content-Type: {shown})", type="invalid_request_error",
                           code="unsupported_media_type")
        replay: list[dict] = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return replayed

    async def _reject(self, send: Callable, error: APIError) -> None:
        body = error_body(error, self._config.max_error_message_chars)
        await send({"type": "http.response.start", "status": error.status,
                    "headers": error_headers(error, body)})
        await send({"type": "http.response.body", "body": body, "more_body": False})
