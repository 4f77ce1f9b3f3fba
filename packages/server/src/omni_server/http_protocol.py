"""uvicorn's h11 HTTP/1.1 protocol with bounded header reads and JSON protocol errors.

- A connection must deliver a complete request head (request line and headers) within ``header_timeout_s``
  of its first byte or of becoming idle-but-started, else it gets 408 and is closed (slowloris); a fresh
  connection that sends nothing is closed after the same time.
- A head still incomplete after ``max_header_bytes`` gets 431 here (h11's incomplete-event limit); a complete
  one that is too large gets 431 from ``http_guard``.
- Every protocol-level error (malformed request line, bad header, oversized head) is answered in the
  OpenAI error shape as ``application/json``, with the status h11 suggests, never uvicorn's ``text/plain``.
"""

from __future__ import annotations

import asyncio
import http
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from omni_server.config import ServerConfig
from omni_server.errors import APIError, error_body, error_headers


class _RecordingConnection(h11.Connection):
    """An h11 connection that remembers the last protocol error (for its status hint)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


def protocol_class(config: ServerConfig) -> type[H11Protocol]:
    header_timeout = config.header_timeout_s
    max_chars = config.max_error_message_chars

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _RecordingConnection(h11.SERVER, self.conn._max_incomplete_event_size)
            self._head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()  # the first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm_head_timer()

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
                self._send_error(APIError(408, f"the request head did not arrive within {header_timeout:g} s",
                                          type="invalid_request_error", code="header_timeout", close=True))
            else:
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            error = self.conn.last_error
            status = getattr(error, "error_status_hint", 400) or 400
            detail = str(error) if error is not None and str(error) else msg
            self._send_error(APIError(status, f"invalid HTTP request: {detail}", type="invalid_request_error",
                                      code="invalid_http_request", close=True))

        def _send_error(self, error: APIError) -> None:
            body = error_body(error, max_chars)
            try:
                output = self.conn.send(h11.Response(status_code=error.status, headers=error_headers(error, body),
                                                    reason=http.HTTPStatus(error.status).phrase.encode()))
                output += self.conn.send(h11.Data(data=body))
                output += self.conn.send(h11.EndOfMessage())
                self.transport.write(output)
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return GuardedH11Protocol
