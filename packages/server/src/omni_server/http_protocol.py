"""uvicorn's h11 HTTP/1.1 protocol with bounded header reads, JSON protocol errors, request ids, and closes
that let every client read its answer.

- A connection must deliver a complete request head (request line and headers) within ``header_timeout_s``
  of its first byte or of becoming idle-but-started, else it gets 408 and is closed (slowloris); a fresh
  connection that sends nothing is closed after the same time.
- A head still incomplete after ``max_header_bytes`` gets 431 here (h11's incomplete-event limit); a complete
  one that is too large gets 431 from ``http_guard``.
- Every protocol-level error (malformed request line, bad header, oversized head) is answered in the
  OpenAI error shape as ``application/json``, with the status h11 suggests, never uvicorn's ``text/plain``.
- Every response carries ``x-request-id``: the request's own when it is sane (1 to 128 of
  ``[A-Za-z0-9._~:+/=-]``), else a new ``req_<32 hex digits>`` (so also on protocol errors, where no request
  was parsed).
- Lingering close: when a response closes the connection while the client is still sending its body (a guard
  refusal: 413, 401, ...), the server half-closes (FIN after the response), then reads and discards the rest of
  the body (its framing parsed by h11) until it ends, the client closes, ``LINGER_MAX_BYTES`` more have come
  or ``body_timeout_s`` has passed, and only then closes the socket. Closing with unread bytes makes the kernel
  send a reset, and a client that writes its whole body before reading (Python's ``http.client``) would get
  ECONNRESET/EPIPE instead of its answer. After a 408 (the client was too slow already) it closes at once.
- Half-closed clients: a client that shuts down its sending side after a complete request (``SHUT_WR``) gets
  its answer, then the connection closes. A FIN alone does not tell such a client from one that closed and
  whose request must be aborted, so until the response starts the server writes an interim
  ``100 Continue`` at once and then at doubling intervals (``HALF_CLOSE_PROBE_S``, capped): a closed client
  answers it with a reset, the next write fails, and the request is aborted as on any disconnect. Every HTTP/1.1
  client skips interim responses (RFC 9110 §15.2); an HTTP/1.0 client gets none, and no abort.
"""

from __future__ import annotations

import asyncio
import http
import re
import uuid
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from omni_server.config import ServerConfig
from omni_server.errors import APIError, error_body, error_headers

REQUEST_ID_HEADER = b"x-request-id"
LINGER_MAX_BYTES = 64 * 2**20
HALF_CLOSE_PROBE_S = (0.05, 1.0)  # first interval, cap
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._~:+/=-]{1,128}")


def new_request_id() -> bytes:
    return b"req_" + uuid.uuid4().hex.encode()


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request's ``x-request-id`` when it is sane (echoed back), else a new one."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            return value if _SANE_REQUEST_ID.fullmatch(value) else new_request_id()
    return new_request_id()


class _ServerConnection(h11.Connection):
    """An h11 server connection that remembers the last protocol error (for its status hint) and the status of
    its last response, and puts the request id on every response."""

    last_error: h11.RemoteProtocolError | None = None
    response_status: int | None = None
    _request_id: bytes | None = None  # of the request being answered; None: none was parsed

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise
        if isinstance(event, h11.Request):
            self._request_id = request_id(event.headers)
        return event

    def send(self, event: Any) -> bytes | None:
        if isinstance(event, h11.Response):
            self.response_status = event.status_code
            headers = [(name, value) for name, value in event.headers if name != REQUEST_ID_HEADER]
            headers.append((REQUEST_ID_HEADER, self._request_id or new_request_id()))
            self._request_id = None
            event = h11.Response(
                status_code=event.status_code, headers=headers, reason=event.reason, http_version=event.http_version
            )
        return super().send(event)


class _TransportWithOwnClose:
    """The transport as uvicorn sees it: everything passes through to the socket's transport but ``close``, which
    the protocol decides (a close now, or a lingering one); once uvicorn has closed it, it is closing for uvicorn
    (no keep-alive timer, no further writes), however long the socket lingers."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self._close = close
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._close()

    def is_closing(self) -> bool:
        return self._closed or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class(config: ServerConfig) -> type[H11Protocol]:
    header_timeout = config.header_timeout_s
    linger_timeout = config.body_timeout_s
    max_chars = config.max_error_message_chars

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _ServerConnection(h11.SERVER, self.conn._max_incomplete_event_size)
            self._head_timer: asyncio.TimerHandle | None = None
            self._socket: asyncio.Transport | None = None  # the real transport (uvicorn's closes go through _close)
            self._linger_timer: asyncio.TimerHandle | None = None  # set while lingering
            self._linger_bytes_left = 0
            self._probe_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._socket = transport
            super().connection_made(_TransportWithOwnClose(transport, self._close))  # type: ignore[arg-type]
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            for timer in (self._linger_timer, self._probe_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._linger_timer is not None:
                self._discard(data)
                return
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()  # the first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm_head_timer()

        def eof_received(self) -> bool | None:
            cycle = self.cycle
            if (
                self._linger_timer is None
                and cycle is not None
                and not cycle.response_complete
                and self.conn.their_state is h11.DONE
            ):
                cycle.keep_alive = False  # answer the half-closed client, then close
                if self.conn.their_http_version != b"1.0":
                    self._probe_half_closed(HALF_CLOSE_PROBE_S[0])
                return True
            return None  # the transport closes: a disconnect for the request, if any

        # -- closing ------------------------------------------------------------------------------------------

        def _close(self) -> None:
            socket = self._socket
            if (
                self._linger_timer is None
                and not socket.is_closing()
                and self.conn.their_state is h11.SEND_BODY
                and self.conn.response_status != 408
            ):
                self._linger_bytes_left = LINGER_MAX_BYTES
                self._linger_timer = self.loop.call_later(linger_timeout, socket.close)
                self._disarm_head_timer()
                socket.write_eof()
                socket.resume_reading()
            else:
                socket.close()

        def _discard(self, data: bytes) -> None:
            """Read on while lingering: drop the body's bytes, close when it ends or the bound is spent."""
            self._linger_bytes_left -= len(data)
            if self._linger_bytes_left < 0:
                self._socket.close()
                return
            self.conn.receive_data(data)
            while True:
                try:
                    event = self.conn.next_event()
                except h11.ProtocolError:
                    event = None
                if event is h11.NEED_DATA:
                    return
                if not isinstance(event, h11.Data):  # the end of the body, or a body h11 cannot frame
                    self._socket.close()
                    return

        def _probe_half_closed(self, interval: float) -> None:
            self._probe_timer = None
            cycle = self.cycle
            if self._socket.is_closing() or cycle is None or cycle.response_started:
                return
            self._socket.write(
                self.conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
            )
            self._probe_timer = self.loop.call_later(
                interval, self._probe_half_closed, min(2 * interval, HALF_CLOSE_PROBE_S[1])
            )

        # -- the request head ---------------------------------------------------------------------------------

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE:
                self._send_error(
                    APIError(
                        408,
                        f"the request head did not arrive within {header_timeout:g} s",
                        type="invalid_request_error",
                        code="header_timeout",
                        close=True,
                    )
                )
            else:
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            error = self.conn.last_error
            status = getattr(error, "error_status_hint", 400) or 400
            detail = str(error) if error is not None and str(error) else msg
            self._send_error(
                APIError(
                    status,
                    f"invalid HTTP request: {detail}",
                    type="invalid_request_error",
                    code="invalid_http_request",
                    close=True,
                )
            )

        def _send_error(self, error: APIError) -> None:
            body = error_body(error, max_chars)
            try:
                output = self.conn.send(
                    h11.Response(
                        status_code=error.status,
                        headers=error_headers(error, body),
                        reason=http.HTTPStatus(error.status).phrase.encode(),
                    )
                )
                output += self.conn.send(h11.Data(data=body))
                output += self.conn.send(h11.EndOfMessage())
                self.transport.write(output)
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return GuardedH11Protocol
