"""Draining the API on shutdown: stop admitting, let the requests in flight finish, then end them cleanly.

On SIGTERM (a rollout, a node drain) ``fusedserve run`` calls ``Drain.shutdown``:

1. ``begin``: ``/health`` answers 503 ``draining`` at once (the pod leaves the Service's endpoints)
   and every new ``/v1`` request gets 503 ``shutting_down`` with ``Retry-After`` and
   ``Connection: close``, so clients retry on another replica;
2. the requests in flight get ``grace_s`` seconds to finish normally;
3. ``expire``: those still running end now, each with a well-formed answer — a JSON 503 when its
   response has not started, an SSE ``error`` event and ``data: [DONE]`` when it is a stream —
   and their engine requests are aborted.

``Drain`` is shared by the thread that handles signals and the server's event loop (a lock; each
request's expiry is a future on its own loop). ``DrainMiddleware`` (ASGI) admits and tracks the
guarded requests.

    drain = Drain(grace_s=30)
    app = build_app(client, metrics, drain=drain)
    ...
    drain.shutdown()  # returns once nothing is in flight (at most grace_s + FLUSH_S)
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .api_error import ApiError, ErrorSink, ignore, send_error

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # after the grace period: how long the ended requests get to write their last bytes
RETRY_AFTER_S = 1  # another replica can take the request at once

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry the request", type="service_unavailable",
                    code="shutting_down", retry_after=RETRY_AFTER_S)


@dataclass(eq=False)
class _Ticket:
    """One admitted request: ``expired`` resolves (on the request's loop) when the grace period ends."""

    loop: asyncio.AbstractEventLoop
    expired: asyncio.Future[None] = field(init=False)

    def __post_init__(self) -> None:
        self.expired = self.loop.create_future()

    def expire(self) -> None:
        def settle() -> None:
            if not self.expired.done():
                self.expired.set_result(None)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: the request is gone
            pass


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._draining = False
        self._expired = False
        self._tickets: set[_Ticket] = set()

    @property
    def draining(self) -> bool:
        return self._draining

    def in_flight(self) -> int:
        with self._cond:
            return len(self._tickets)

    # --- the server's side -----------------------------------------------------------------------

    def admit(self) -> _Ticket | None:
        """A ticket for a new request, or None while draining (the caller answers 503)."""
        with self._cond:
            if self._draining:
                return None
            ticket = _Ticket(asyncio.get_running_loop())
            self._tickets.add(ticket)
            return ticket

    def release(self, ticket: _Ticket) -> None:
        with self._cond:
            self._tickets.discard(ticket)
            self._cond.notify_all()

    # --- the shutting-down side ------------------------------------------------------------------

    def begin(self) -> None:
        with self._cond:
            self._draining = True

    def expire(self) -> None:
        """End every request still in flight (and any admitted later: none are)."""
        with self._cond:
            self._draining = self._expired = True
            tickets = list(self._tickets)
        for ticket in tickets:
            ticket.expire()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is in flight (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._tickets:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def shutdown(self, stop_early: threading.Event | None = None) -> int:
        """begin, wait up to ``grace_s`` (less if ``stop_early`` is set), expire, flush; returns the
        number of requests that had to be ended."""
        self.begin()
        deadline = time.monotonic() + self.grace_s
        while not self.wait_idle(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (stop_early is not None and stop_early.is_set()):
                break
        ended = self.in_flight()
        if ended:
            log.warning("grace period over: ending %d request(s) still in flight", ended)
        self.expire()
        if not self.wait_idle(FLUSH_S):
            log.warning("%d request(s) did not end within %.0f s of the grace period", self.in_flight(), FLUSH_S)
        return ended


class DrainMiddleware:
    """ASGI: admits the requests ``guarded(path)`` says are work (``/v1/...``) while not draining,
    and ends the ones the grace period did not see finish."""

    def __init__(self, app: Any, drain: Drain, guarded: Callable[[str], bool], sink: ErrorSink = ignore) -> None:
        self.app = app
        self.drain = drain
        self.guarded = guarded
        self.sink = sink

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        ticket = self.drain.admit()
        if ticket is None:
            await send_error(send, shutting_down(), close=True, sink=self.sink)
            return
        state = _ResponseState()

        async def tracked_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state.started = True
                state.stream = _is_event_stream(message.get("headers", []))
                if self.drain.draining:  # finishing during the drain: no keep-alive
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state.finished = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        try:
            await asyncio.wait({task, ticket.expired}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return
            task.cancel()  # aborts its engine requests (their streams close)
            await asyncio.gather(task, return_exceptions=True)
            await _end(state, send, self.sink)
        finally:
            if not task.done():
                task.cancel()
            self.drain.release(ticket)


@dataclass
class _ResponseState:
    started: bool = False
    stream: bool = False
    finished: bool = False


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


async def _end(state: _ResponseState, send: Send, sink: ErrorSink) -> None:
    """The last bytes of a request ended by the drain."""
    if state.finished:
        return
    error = ApiError(503, "the server shut down before the request finished; retry it", type="service_unavailable",
                     code="shutting_down", retry_after=RETRY_AFTER_S)
    try:
        if not state.started:
            await send_error(send, error, close=True, sink=sink)
        elif state.stream:
            sink(error)
            body = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:  # a JSON body half sent: nothing well-formed can follow, end it
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError as e:  # the client is gone
        log.debug("ending a drained request: %s", e)
