"""One leader's output stream, read on one event loop by the group controller.

The controller sends each request to a leader with ``RankActor.submit(..., channel)`` and reads the
outputs of all of them from one long-lived Ray streaming call, ``RankActor.outputs(channel)``: each
Ray object is one wake-up of the leader's loop with every output delivered meanwhile (an engine
step's outputs of every request together), not one object per request per step — the leader's
process serialises and the Ray core moves one item per step however many requests run. The pump
hands each output to its request's queue. When the stream fails (the leader died) or the engine
reports itself dead, every request on it gets ``EngineDead``; a new request then opens a new pump.

    pump = OutputPump(leader, group_index=0, on_end=forget)   # on the controller's running loop
    queue = pump.open("req-1")                                # before submitting the request
    await leader.submit.remote(prompt, params, "req-1", pump.channel)
    item = await queue.get()                                  # an output dict, or EngineDead
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import ray

from ..serving.engine_client import EngineDead
from .engine_group import short

log = logging.getLogger(__name__)


class OutputPump:
    def __init__(self, leader: Any, group_index: int, on_end: Callable[[OutputPump], None] | None = None) -> None:
        self.leader = leader
        self.group_index = group_index
        self.channel = uuid.uuid4().hex  # this pump's requests on the leader
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, asyncio.Queue[dict[str, Any] | EngineDead]] = {}
        self.error: EngineDead | None = None
        self._on_end = on_end
        self.task = self.loop.create_task(self._run(), name=f"fusedserve-outputs-{group_index}")

    @property
    def alive(self) -> bool:
        return self.error is None and not self.task.done()

    def open(self, request_id: str) -> asyncio.Queue[dict[str, Any] | EngineDead]:
        """The queue a request's outputs will arrive on (open it before submitting the request)."""
        if self.error is not None:
            raise self.error
        queue: asyncio.Queue[dict[str, Any] | EngineDead] = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def _run(self) -> None:
        group = self.group_index
        error: EngineDead | None = None
        try:
            stream = self.leader.outputs.options(num_returns="streaming").remote(self.channel)
            async for ref in stream:
                for item in await ref:
                    if "engine_dead" in item:
                        error = EngineDead(f"engine group {group}: {item['engine_dead']}")
                        break
                    queue = self.queues.get(item["request_id"])
                    if queue is not None:  # else its consumer went away (the leader aborts it)
                        queue.put_nowait(item)
                if error is not None:
                    break
            else:
                error = EngineDead(f"engine group {group} ended its output stream")
        except asyncio.CancelledError:
            error = EngineDead("the controller stopped")
            raise
        except ray.exceptions.RayError as e:
            error = EngineDead(f"engine group {group} failed: {short(e)}")
        except Exception as e:  # noqa: BLE001 (every request on the stream must hear of it)
            log.exception("output stream of engine group %d", group)
            error = EngineDead(f"engine group {group}: output stream failed: {type(e).__name__}: {e}")
        finally:
            self.error = error or EngineDead(f"engine group {group}: output stream ended")
            for queue in self.queues.values():
                queue.put_nowait(self.error)
            if self._on_end is not None:
                self._on_end(self)
