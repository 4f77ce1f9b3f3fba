"""The ASGI guard in front of the routes: what every request must satisfy before any route sees it.

The app installs it with ``install_guards`` (one middleware in front of every route); ``unguarded_routes`` walks
an app's middleware stack and names the routes a request could reach without it (the app's tests assert none).

In order, each failure answered in the OpenAI error shape and changing nothing:
- CORS (only with ``allowed_origins``): a preflight is answered here, a refused one as a 400 ``cors_not_allowed``
  (Starlette's own refusal is ``text/plain``); every answer below gets the CORS headers, so a page of an allowed
  origin can read its refusals (``x-request-id``, ``x-should-retry`` and ``Retry-After`` are exposed to it);
- at most ``max_header_count`` headers of at most ``max_header_bytes`` in all (431; a head that never completes
  is bounded below, by h11 in ``http_protocol``);
- a ``Host`` header the server answers to (400 ``invalid_host``): ``allowed_hosts``, by default the loopback
  names when the server is bound to a loopback address (DNS-rebinding protection), any host otherwise;
- while the server drains, every route but ``/health`` and ``/metrics`` answers 503 ``server_shutting_down``;
- ``Authorization: Bearer <api_key>`` on ``/v1/*`` when ``api_key`` is set, the scheme in any case (RFC 7235)
  (401 ``invalid_api_key``);
- not both ``Content-Length`` and ``Transfer-Encoding`` (400 ``invalid_http_request``; RFC 9112 §6.3: such a
  request may be a smuggling attempt, and the connection is closed after the answer);
- a body of at most ``max_request_body_bytes`` (413; a larger ``Content-Length`` is refused unread), sent as
  JSON (``Content-Type: application/json``), or also as ``multipart/form-data`` on the ``multipart_paths``
  (the routes that take files), else 415; completely within ``body_timeout_s`` (408). The body is read here,
  so a route never waits on a slow client, and then replayed to the route.
Rejections that leave unread body bytes close the connection (``http_protocol`` first discards, within bounds,
what the client still sends, so a client that writes its whole body before reading still reads the answer).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Callable, Collection

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import WebSocketRoute

from omni_server.config import ServerConfig
from omni_server.errors import APIError, error_body, error_headers

ASGIApp = Callable  # (scope, receive, send) -> awaitable
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
JSON_MEDIA_TYPE = b"application/json"
MULTIPART_MEDIA_TYPE = b"multipart/form-data"
_ALWAYS_OPEN = ("/health", "/metrics")


def install_guards(
    app: FastAPI, config: ServerConfig, *, draining: Callable[[], bool], multipart_paths: Collection[str] = ()
) -> None:
    """Put ``HTTPGuard`` (CORS included) in front of every route of ``app``; call it once, before the app starts.

    ``draining`` says whether the server is draining; ``multipart_paths`` are the paths whose bodies may also be
    ``multipart/form-data`` (routes that take files), every other body must be JSON.
    """
    app.add_middleware(HTTPGuard, config=config, draining=draining, multipart_paths=multipart_paths)


def unguarded_routes(app: FastAPI) -> list[str]:
    """The paths of ``app``'s routes that a request can reach without passing ``HTTPGuard``; empty when none.

    Walks the middleware stack the app runs (built as it would be at its first request), outermost first, down to
    its router: without a guard on that path every route is unguarded. WebSocket routes always are: the guard
    checks HTTP requests only.
    """
    layer = app.middleware_stack or app.build_middleware_stack()
    while layer is not app.router and not isinstance(layer, HTTPGuard):
        layer = getattr(layer, "app", app.router)  # a layer that hides what it wraps counts as no guard
    guarded = isinstance(layer, HTTPGuard)
    return [
        getattr(route, "path", repr(route))
        for route in app.router.routes
        if not guarded or isinstance(route, WebSocketRoute)
    ]


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


def bearer_token(authorization: bytes) -> bytes | None:
    """The token of ``Authorization: Bearer <token>``, the scheme in any case (RFC 7235 §2.1); None otherwise."""
    scheme, _, token = authorization.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else None


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS for ``allowed_origins``, with its refused preflights answered in the OpenAI error shape."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        super().__init__(
            app,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-request-id"],
            expose_headers=["x-request-id", "x-should-retry", "retry-after"],
            allow_credentials=False,
        )
        self._max_chars = config.max_error_message_chars

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        error = APIError(
            400,
            f"CORS preflight refused ({refused} not allowed) for origin "
            f"{request_headers['origin'][:100]!r}: this server allows the origins "
            f"{', '.join(self.allow_origins)} (--allowed-origins), the methods "
            f"{', '.join(self.allow_methods)} and the headers {', '.join(self.allow_headers)}",
            type="invalid_request_error",
            code="cors_not_allowed",
        )
        headers = {
            name: value for name, value in response.headers.items() if name not in ("content-type", "content-length")
        }
        return Response(
            error_body(error, self._max_chars),
            status_code=400,
            headers={**headers, **error.headers},
            media_type="application/json",
        )


class HTTPGuard:
    """The one middleware in front of every route (see the module docstring for its rules, in order)."""

    def __init__(
        self, app: ASGIApp, config: ServerConfig, *, draining: Callable[[], bool], multipart_paths: Collection[str] = ()
    ) -> None:
        self.app = app
        self._config = config
        self._draining = draining
        self._multipart_paths = frozenset(multipart_paths)
        self._hosts = allowed_host_names(config)
        self._api_key = config.api_key.encode() if config.api_key else None
        self._front: ASGIApp = OpenAICORSMiddleware(self._guarded, config) if config.allowed_origins else self._guarded

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self._front(scope, receive, send)

    async def _guarded(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            receive = await self._check(scope, receive)
        except APIError as error:
            await self._reject(send, error)
            return
        if receive is None:  # the client went away while sending its body
            return
        await self.app(scope, receive, send)

    async def _check(self, scope: dict, receive: Callable) -> Callable | None:
        config, headers = self._config, scope["headers"]
        if len(headers) > config.max_header_count:
            raise APIError(
                431,
                f"too many headers: {len(headers)}; at most {config.max_header_count} are accepted",
                type="invalid_request_error",
                code="too_many_headers",
                close=True,
            )
        head_bytes = sum(len(name) + len(value) + 4 for name, value in headers)
        if head_bytes > config.max_header_bytes:
            raise APIError(
                431,
                f"the request headers have {head_bytes} bytes; at most {config.max_header_bytes} are "
                "accepted (--max-header-bytes)",
                type="invalid_request_error",
                code="headers_too_large",
                close=True,
            )
        values: dict[bytes, bytes] = {}
        for name, value in headers:
            values.setdefault(name, value)
        if self._hosts is not None:
            host = host_name(values.get(b"host", b"").decode("latin-1"))
            if host not in self._hosts:
                raise APIError(
                    400,
                    f"this server does not answer to Host {host[:100]!r}; allowed: "
                    f"{', '.join(sorted(self._hosts))} (see --allowed-hosts)",
                    type="invalid_request_error",
                    param="Host",
                    code="invalid_host",
                    close=True,
                )
        path = scope["path"]
        if self._draining() and path not in _ALWAYS_OPEN:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type="service_unavailable",
                code="server_shutting_down",
                headers={"Retry-After": "5"},
                close=True,
            )
        if self._api_key is not None and path.startswith("/v1/") and scope["method"] != "OPTIONS":
            token = bearer_token(values.get(b"authorization", b""))
            if token is None or not hmac.compare_digest(token, self._api_key):
                raise APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <api key>'",
                    type="invalid_request_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                    close=True,
                )
        return await self._read_body(scope, values, receive)

    async def _read_body(self, scope: dict, values: dict[bytes, bytes], receive: Callable) -> Callable | None:
        takes_files = scope["path"] in self._multipart_paths
        limit = self._config.max_form_body_bytes if takes_files else self._config.max_request_body_bytes
        flags = "--max-request-body-bytes" + (" + 4 x --max-input-image-bytes" if takes_files else "")
        length_header = values.get(b"content-length")
        if length_header is not None and b"transfer-encoding" in values:
            raise APIError(
                400,
                "invalid HTTP request: it has both Content-Length and Transfer-Encoding, which frame "
                "the body in two ways (RFC 9112 §6.3); send only one of them",
                type="invalid_request_error",
                code="invalid_http_request",
                close=True,
            )
        chunked = b"chunked" in values.get(b"transfer-encoding", b"").lower()
        if length_header is None and not chunked:
            return receive  # no body
        if length_header is not None:
            try:
                length = int(length_header)
            except ValueError:
                length = -1
            if length < 0:
                raise APIError(
                    400,
                    "Content-Length must be a non-negative integer",
                    type="invalid_request_error",
                    code="invalid_content_length",
                    close=True,
                )
            if length > limit:
                raise APIError(
                    413,
                    f"the request body has {length} bytes; at most {limit} are accepted ({flags})",
                    type="invalid_request_error",
                    code="body_too_large",
                    close=True,
                )
            if length == 0:
                return receive
        body = bytearray()
        deadline = time.monotonic() + self._config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {self._config.body_timeout_s:g} s",
                    type="invalid_request_error",
                    code="body_timeout",
                    close=True,
                ) from None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise APIError(
                    413,
                    f"the request body exceeds {limit} bytes ({flags})",
                    type="invalid_request_error",
                    code="body_too_large",
                    close=True,
                )
            if not message.get("more_body", False):
                break
        if body:
            self._check_media_type(scope["path"], values.get(b"content-type", b""))
        replay: list[dict] = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return replayed

    def _check_media_type(self, path: str, content_type: bytes) -> None:
        media_type = content_type.split(b";", 1)[0].strip().lower()
        if media_type == JSON_MEDIA_TYPE or media_type.endswith(b"+json"):
            return
        takes_files = path in self._multipart_paths
        if takes_files and media_type == MULTIPART_MEDIA_TYPE:
            return
        shown = media_type.decode("latin-1")[:100] or "none"
        accepted = (
            "JSON sent with 'Content-Type: application/json', or a form sent as 'multipart/form-data'"
            if takes_files
            else "JSON sent with 'Content-Type: application/json'"
        )
        raise APIError(
            415,
            f"the request body of {path[:100]} must be {accepted} (got Content-Type: {shown})",
            type="invalid_request_error",
            code="unsupported_media_type",
        )

    async def _reject(self, send: Callable, error: APIError) -> None:
        body = error_body(error, self._config.max_error_message_chars)
        await send({"type": "http.response.start", "status": error.status, "headers": error_headers(error, body)})
        await send({"type": "http.response.body", "body": body, "more_body": False})
