"""The engine streams of one API request, merged (pure asyncio, no HTTP): a request with n choices
or a batch of prompts runs one engine request per sequence.

``merge`` yields ``(index, output)`` from every stream as they come (the first outputs, already
awaited, first); ``close_all`` closes the streams (aborting unfinished engine requests);
``disconnected`` returns when the HTTP client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ..engine.outputs import RequestOutput


async def merge(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from every stream, first outputs first, then as they come."""
    for index, out in enumerate(firsts):
        yield index, out
    live = [i for i, out in enumerate(firsts) if not out.finished]
    if len(live) == 1:  # the common case: no tasks needed
        async for out in streams[live[0]]:
            yield live[0], out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for out in streams[index]:
                queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 (re-raised by the consumer)
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except RuntimeError:  # still running in a task being cancelled; it closes itself
                pass


async def disconnected(request: Any) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
