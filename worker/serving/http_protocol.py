"""uvicorn's h11 protocol with a header timeout (uvicorn has none: a connection that sends half a
request line, or nothing at all, would be held forever).

A connection must deliver a request's headers within ``header_timeout_s`` of opening, or of the
first bytes after a response (an idle keep-alive connection is uvicorn's to close, after
``timeout_keep_alive``). Past it the server answers 408 and closes the connection. Bodies have
their own timeout (``request_body.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request headers did not arrive within {timeout_s:g} s "
                                            "(spec.serving.headerTimeoutSeconds)",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s: float = 10.0  # set per server by ``with_header_timeout``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()
        super().data_received(data)
        if not self._between_requests():  # the headers are in: the request runs
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        log.info("closing a connection from %s: no request headers within %.0f s", self.client, self.header_timeout_s)
        self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def with_header_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for one server."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": timeout_s})
