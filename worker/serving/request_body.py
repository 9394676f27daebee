"""Bounded request bodies and slow clients (ASGI middleware), before any app code runs.

- A declared ``Content-Length`` above ``max_bytes`` is answered 413 before one byte is read; a
  body without one (chunked) is read up to ``max_bytes`` and answered 413 past it. Either way the
  rest is read and thrown away for at most ``LINGER_BYTES`` / ``LINGER_S`` before the answer, so
  a client that uploads before it reads sees the 413 instead of a reset connection (a client that
  sent ``Expect: 100-continue`` is answered at once: it uploads nothing).
- The whole body must arrive within ``body_timeout_s`` (408 otherwise): half a body, or a
  ``Content-Length`` larger than what is sent, no longer holds a request forever.
- The app then reads the buffered body (one message) and, after it, the connection's own
  messages (a disconnect).
- A response chunk the client does not take within ``send_timeout_s`` (a reader that stopped
  reading a stream) ends the request: ``SlowClient`` is raised into the app, which aborts its
  engine requests, and the connection is closed.

Header timeouts and the connection limit are the server's (``http_server.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .api_error import ApiError, ErrorSink, ignore, send_error

log = logging.getLogger(__name__)

LINGER_BYTES = 32 << 20
LINGER_S = 2.0


class SlowClient(ConnectionError):
    """The client did not read a response chunk within the send timeout."""


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes (spec.serving.maxRequestBytes)",
                    code="request_too_large")


def too_slow(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                         "(spec.serving.bodyTimeoutSeconds)", code="request_timeout")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


class RequestBodyMiddleware:
    def __init__(self, app: Any, max_bytes: int, body_timeout_s: float, send_timeout_s: float,
                 sink: ErrorSink = ignore) -> None:
        self.app = app
        self.sink = sink
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        declared = _header(headers, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_error(send, ApiError(400, "Content-Length is not a number"), close=True, sink=self.sink)
                return
            if int(declared) > self.max_bytes:
                if (_header(headers, b"expect") or b"").lower() != b"100-continue":
                    await _discard(receive, int(declared))
                await send_error(send, too_large(self.max_bytes), close=True, sink=self.sink)
                return
        body = await self._read(receive, send)
        if body is None:
            return

        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # type: ignore[no-any-return]

        async def bounded_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                log.info("a client took no response bytes for %.0f s: ending its request", self.send_timeout_s)
                raise SlowClient(f"no response bytes taken for {self.send_timeout_s:g} s") from None

        try:
            await self.app(scope, replay, bounded_send)
        except SlowClient:
            pass  # the server closes the connection: the response never completed

    async def _read(self, receive: Callable[[], Any], send: Callable[..., Any]) -> bytes | None:
        """The whole body, or None once an answer (413, 408) went out or the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await send_error(send, too_slow(self.body_timeout_s), close=True, sink=self.sink)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _discard(receive, LINGER_BYTES)
                await send_error(send, too_large(self.max_bytes), close=True, sink=self.sink)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _discard(receive: Callable[[], Any], limit: int) -> None:
    """Read and drop up to ``limit`` more body bytes for at most LINGER_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_S
    dropped = 0
    while dropped < min(limit, LINGER_BYTES):
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
