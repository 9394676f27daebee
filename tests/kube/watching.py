"""Watch events of the emulated API server: their history (to resume from a resourceVersion),
their live subscribers, and what one watch request gets to see of them.

Everything here runs on the server's event loop; ``publish`` is synchronous, so a write and its event
are atomic with respect to other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import kmock

from tests.kube.selectors import Selector


@dataclass(frozen=True)
class WatchEvent:
    resource_version: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the previous version (MODIFIED, DELETED)


@dataclass(frozen=True)
class WatchScope:
    """What one watch request asked for: namespace (None: all), object name (None: all), selectors."""

    namespace: str | None = None
    name: str | None = None
    selector: Selector = field(default_factory=Selector)

    def covers(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and (self.name is None or meta.get("name") == self.name)
                and self.selector.matches(obj))

    def view(self, event: WatchEvent) -> tuple[str, dict[str, Any]] | None:
        """The event as this watch sees it: an object leaving the selection is DELETED, entering is ADDED."""
        now, before = self.covers(event.obj), self.covers(event.old)
        if event.type == "ADDED":
            return ("ADDED", event.obj) if now else None
        if event.type == "DELETED":
            return ("DELETED", event.obj) if now or before else None
        if now:
            return ("MODIFIED" if before else "ADDED", event.obj)
        return ("DELETED", event.obj) if before else None


Subscriber = asyncio.Queue[WatchEvent | None]  # None: the stream must end


class WatchHub:
    """Per-resource event history and live subscribers."""

    def __init__(self, history_limit: int = 10_000) -> None:
        self.history_limit = history_limit
        self._history: dict[kmock.resource, list[WatchEvent]] = {}
        self._subscribers: dict[kmock.resource, set[Subscriber]] = {}

    def publish(self, resource: kmock.resource, event: WatchEvent) -> None:
        history = self._history.setdefault(resource, [])
        history.append(event)
        del history[:-self.history_limit]
        for queue in self._subscribers.get(resource, ()):
            queue.put_nowait(event)

    def history(self, resource: kmock.resource) -> list[WatchEvent]:
        return list(self._history.get(resource, ()))

    def since(self, resource: kmock.resource, resource_version: int) -> list[WatchEvent] | None:
        """Events after ``resource_version``; None when older ones were already dropped (410 Gone)."""
        history = self._history.get(resource, [])
        if len(history) == self.history_limit and history[0].resource_version > resource_version + 1:
            return None
        return [e for e in history if e.resource_version > resource_version]

    def subscribe(self, resource: kmock.resource) -> Subscriber:
        queue: Subscriber = asyncio.Queue()
        self._subscribers.setdefault(resource, set()).add(queue)
        return queue

    def streams(self, plural: str) -> int:
        """Live watch streams on resources of this plural (any group and version); safe from another thread
        (the dict copied in one step)."""
        return sum(len(queues) for key, queues in list(self._subscribers.items()) if key.plural == plural)

    def unsubscribe(self, resource: kmock.resource, queue: Subscriber) -> None:
        self._subscribers.get(resource, set()).discard(queue)

    def end_streams(self, resource: kmock.resource | None = None) -> None:
        """Ask the live streams (of one resource, or all) to finish."""
        for key, queues in self._subscribers.items():
            if resource is None or key == resource:
                for queue in queues:
                    queue.put_nowait(None)


async def pump(response: aiohttp.web.StreamResponse, initial: list[bytes], queue: Subscriber, scope: WatchScope,
               render: Callable[[str, dict[str, Any]], bytes], timeout: float, *,
               stop: Callable[[], bool], client_gone: Callable[[], bool]) -> None:
    """Write the ``initial`` chunks, then the subscriber's events as ``scope`` sees them, until the timeout,
    ``stop()``, the end of the stream (a None in the queue) or the client going away; then end the response."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        for chunk in initial:
            await response.write(chunk)
        while not stop() and (remaining := deadline - loop.time()) > 0:
            try:
                event = await asyncio.wait_for(queue.get(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                if client_gone():
                    return
                continue
            if event is None:
                break
            seen = scope.view(event)
            if seen:
                await response.write(render(*seen))
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client went away mid-write
