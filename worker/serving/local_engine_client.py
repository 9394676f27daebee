"""An in-process ``Engine`` behind the ``EngineClient`` protocol, driven by a background thread.

The engine is single-threaded: only the engine thread touches it. Callers (coroutines on any
event loop) hand it work as commands; the thread runs the queued commands between steps,
steps while requests are unfinished and otherwise sleeps on a condition variable. Each
request's outputs go to its own asyncio queue through ``loop.call_soon_threadsafe`` (``generate``),
or — for a consumer in another process, a Ray group leader's output stream — to an
``OutputChannel`` that many requests share (``submit``): a step's outputs arrive there as one
delivery. A consumer that stops iterating (a client that went away) aborts its request.

If a step raises, the engine is dead: every request in flight gets ``EngineDead`` and so does
every later call. The same class runs inside a Ray group-leader actor, so it knows no HTTP.

    client = LocalEngineClient(Engine(model_dir), {"deployment": "demo", "engine_group": "0"})
    async for out in client.generate("def fib(n):", SamplingParams(max_tokens=8), "req-1"):
        ...
    client.close()
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from typing_extensions import Self

from ..engine.engine import Engine
from ..engine.outputs import RequestOutput, merge_outputs
from ..engine.sequence import FinishReason, SamplingParams
from ..engine.tokenizer import Tokenizer
from .engine_client import SNAPSHOT_LABELS, EngineDead, MetricsSnapshot
from .engine_stats import ledger_snapshot, spec_snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")
_Item = RequestOutput | EngineDead


class _Command(Generic[T]):
    """Work for the engine thread; its result (or error) resolves a future on the caller's loop."""

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[T] | None = loop.create_future() if loop is not None else None

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as e:  # noqa: BLE001 (handed to the caller, whatever it is)
            self._resolve(None, e)
        else:
            self._resolve(result, None)

    def fail(self, error: BaseException) -> None:
        self._resolve(None, error)

    def _resolve(self, result: T | None, error: BaseException | None) -> None:
        if self.future is None or self.loop is None:
            if error is not None and not isinstance(error, EngineDead):
                log.warning("engine command failed: %s", error)
            return
        future = self.future

        def settle() -> None:
            if future.done():  # the caller was cancelled
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed
            pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


class OutputChannel:
    """Many requests' outputs on one queue, for one consumer across a process boundary (a Ray stream):
    each ``next_batch`` returns everything delivered since the last one — every request's outputs of
    an engine step in one piece, not one piece per request. Made on the consumer's loop
    (``LocalEngineClient.open_channel``); an ``EngineDead`` in a batch ends every request on it."""

    def __init__(self) -> None:
        self.stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.requests: set[str] = set()  # submitted and not yet finished

    async def next_batch(self) -> list[_Item]:
        """What was delivered since the last call (waits for at least one item); a request's
        consecutive outputs merged into one."""
        queue = self.stream.queue
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        dead = [i for i in items if isinstance(i, EngineDead)]
        per_request: dict[str, list[RequestOutput]] = {}
        for item in items:
            if isinstance(item, RequestOutput):
                per_request.setdefault(item.request_id, []).append(item)
                if item.finished:
                    self.requests.discard(item.request_id)
        return [*(merge_outputs(outs) for outs in per_request.values()), *dead[:1]]


@dataclass
class _Track:
    """A request the engine holds. ``stream`` is None once its consumer went away. A ``final_only``
    request's outputs wait in ``held`` (engine thread only) until its last one."""

    stream: _Stream | None
    final_only: bool = False
    prompt_counted: bool = False
    held: list[RequestOutput] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # when each held output with tokens was made


class LocalEngineClient:
    def __init__(self, engine: Engine, labels: Mapping[str, str] | None = None, *,
                 model_name: str = "default") -> None:
        self.engine = engine
        self.labels = {k: str((labels or {}).get(k, "")) for k in SNAPSHOT_LABELS}
        self._model_name = model_name
        # a copy the engine thread never touches, copied again for each HTTP tokenizer thread
        self._tokenizer = None if engine.tokenizer is None else copy.deepcopy(engine.tokenizer)
        self._cond = threading.Condition()
        self._commands: deque[_Command[Any]] = deque()
        self._stopping = False
        self._dead: str | None = None  # why the engine thread ended
        # Engine-thread state: requests in the engine, and the serving counters.
        self._tracks: dict[str, _Track] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="fusedserve-engine", daemon=True)
        self._thread.start()

    # --- EngineClient ----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def load_tokenizer(self) -> Tokenizer | None:
        return None if self._tokenizer is None else copy.deepcopy(self._tokenizer)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       final_only: bool = False) -> AsyncIterator[RequestOutput]:
        async for chunk in self._chunks(prompt, params, request_id, final_only):
            for item in chunk:
                yield item

    async def _chunks(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                      final_only: bool = False) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs, each time as many as have queued up (at least one)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        track = _Track(_Stream(loop, queue), final_only)
        finished = False

        def add() -> None:
            self.engine.add_request(prompt, params, request_id)
            self._tracks[request_id] = track

        try:
            await self._call(add)
            while not finished:
                items = [await queue.get()]
                while not queue.empty() and not (isinstance(items[-1], RequestOutput) and items[-1].finished):
                    items.append(queue.get_nowait())
                dead = next((i for i in items if isinstance(i, EngineDead)), None)
                outs = [i for i in items if isinstance(i, RequestOutput)]
                if outs:
                    finished = outs[-1].finished
                    yield outs
                if dead is not None:
                    raise dead
        finally:
            if not finished:
                self._detach(request_id, track)

    def open_channel(self) -> OutputChannel:
        """A channel for ``submit`` (call on the loop that will read it)."""
        return OutputChannel()

    async def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     channel: OutputChannel, final_only: bool = False) -> None:
        """Start a request whose outputs go to ``channel`` (raises ``InvalidRequest`` here); ``final_only``
        as in ``generate``."""
        track = _Track(channel.stream, final_only)

        def add() -> None:
            self.engine.add_request(prompt, params, request_id)
            self._tracks[request_id] = track

        channel.requests.add(request_id)  # before any output of it can arrive
        try:
            await self._call(add)
        except BaseException:
            channel.requests.discard(request_id)
            raise

    def close_channel(self, channel: OutputChannel) -> None:
        """Its consumer went away: abort every request of it that is still running."""
        for request_id in list(channel.requests):
            track = self._tracks.get(request_id)
            if track is not None:
                self._detach(request_id, track)
        channel.requests.clear()

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its consumer receives a last output with reason "abort"."""
        await self._call(lambda: self.engine.abort(request_id))

    async def status(self) -> dict[str, Any]:
        snapshot = await self._snapshot_now()
        return {
            "model": self._model_name,
            "ready": self._dead is None,
            "error": self._dead,
            "max_model_len": self.engine.max_model_len,
            "groups": [group_status(snapshot, ready=self._dead is None)],
        }

    async def metrics(self) -> list[MetricsSnapshot]:
        return [await self._snapshot_now()]

    # --- lifecycle -------------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the current step; requests in flight get ``EngineDead``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0f s", timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- caller side -----------------------------------------------------------------------------

    def _submit(self, command: _Command[Any]) -> None:
        with self._cond:
            if self._dead is not None or self._stopping:
                raise EngineDead(self._dead or "the engine is shutting down")
            self._commands.append(command)
            self._cond.notify()

    async def _call(self, fn: Callable[[], T]) -> T:
        command = _Command(fn, asyncio.get_running_loop())
        self._submit(command)
        assert command.future is not None
        return await command.future

    async def _snapshot_now(self) -> MetricsSnapshot:
        if self._thread.is_alive():
            try:
                return await self._call(self._snapshot)
            except EngineDead:
                pass
        self._thread.join()  # the engine is no longer stepping: read it from here
        return self._snapshot()

    def _detach(self, request_id: str, track: _Track) -> None:
        """The consumer went away: abort the request if it is still this consumer's."""

        def detach() -> None:
            if self._tracks.get(request_id) is track:
                track.stream = None
                self.engine.abort(request_id)

        try:
            self._submit(_Command(detach))
        except EngineDead:
            pass

    # --- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        reason = "the engine was closed"
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or busy):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, deque()
                for command in commands:
                    command.run()
                if self.engine.has_unfinished():
                    self._route(self.engine.step())
                busy = self.engine.has_unfinished()
        except Exception as e:
            log.exception("engine step failed; the engine is dead")
            reason = f"the engine failed: {type(e).__name__}: {e}"
        self._die(reason)

    def _die(self, reason: str) -> None:
        with self._cond:
            self._dead = reason
            commands, self._commands = self._commands, deque()
        for command in commands:
            command.fail(EngineDead(reason))
        tracks, self._tracks = self._tracks, {}
        for track in tracks.values():
            if track.stream is not None:
                self._deliver(track.stream, [EngineDead(reason)])

    def _route(self, outputs: list[RequestOutput]) -> None:
        batches: dict[int, tuple[_Stream, list[_Item]]] = {}
        now = time.monotonic()
        for out in outputs:
            track = self._tracks.get(out.request_id)
            self._count(out, track)
            if track is None:
                continue
            if out.finished:
                del self._tracks[out.request_id]
            if track.final_only:
                track.held.append(out)
                if out.new_token_ids:
                    track.stamps.append(now)
                if not out.finished:
                    continue
                gaps = tuple(b - a for a, b in zip(track.stamps, track.stamps[1:]))
                out, track.held, track.stamps = replace(merge_outputs(track.held), gaps=gaps), [], []
            if track.stream is not None:
                batches.setdefault(id(track.stream), (track.stream, []))[1].append(out)
        for stream, items in batches.values():
            self._deliver(stream, items)

    def _deliver(self, stream: _Stream, items: list[_Item]) -> None:
        def put() -> None:
            for item in items:
                stream.queue.put_nowait(item)

        try:
            stream.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the consumer's loop is closed: nobody listens any more
            for item in items:
                if isinstance(item, RequestOutput) and not item.finished:
                    self.engine.abort(item.request_id)

    def _count(self, out: RequestOutput, track: _Track | None) -> None:
        self._generation_tokens += len(out.new_token_ids)
        computed = bool(out.new_token_ids) or (out.finished and out.finish_reason is not FinishReason.ABORT)
        if track is not None and computed and not track.prompt_counted:
            track.prompt_counted = True
            self._prompt_tokens += out.num_prompt_tokens
        if out.finished and out.finish_reason is not None:
            self._finished[out.finish_reason.value] += 1

    def _snapshot(self) -> MetricsSnapshot:
        stats = self.engine.stats()
        ledger = self.engine.collective_ledger()
        collectives = ledger_snapshot(ledger, self.labels) if ledger is not None else MetricsSnapshot(dict(self.labels))
        return replace(
            collectives,
            spec=spec_snapshot(self.engine),
            serving={
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "kv_usage": stats.kv_usage,
                "preemptions": stats.num_preemptions,
                "prefix_caching": stats.prefix_caching,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "prompt_tokens": self._prompt_tokens,
                "generation_tokens": self._generation_tokens,
                "finished": dict(self._finished),
            },
        )


def group_status(snapshot: MetricsSnapshot, ready: bool) -> dict[str, Any]:
    """The ``/status`` entry of one group (or rank): load, acceptance length, plan vs execution."""
    executed: Counter[tuple[str, str]] = Counter()
    for (op, group, _path), n in snapshot.collective_calls.items():
        executed[(op, group)] += n
    planned_total = snapshot.collective_planned
    keys = sorted(set(executed) | set(planned_total))
    spec = snapshot.spec
    drafts = int(spec.get("drafts", 0))
    serving = snapshot.serving
    return {
        "labels": snapshot.labels,
        "ready": ready,
        "num_requests_running": serving.get("running", 0),
        "num_requests_waiting": serving.get("waiting", 0),
        "kv_cache_usage": serving.get("kv_usage", 0.0),
        "prefix_caching": serving.get("prefix_caching", False),
        "prefix_cache_hit_rate": (serving["prefix_cache_hits"] / serving["prefix_cache_queries"]
                                  if serving.get("prefix_cache_queries") else None),
        "acceptance_length": 1 + int(spec.get("accepted_tokens", 0)) / drafts if drafts else None,
        "collectives": {
            "forwards": snapshot.forwards,
            "per_op": [{"op": op, "group": group, "planned": planned_total.get((op, group), 0),
                        "executed": executed[(op, group)]}
                       for op, group in keys],
            "matches_plan": all(planned_total.get(k, 0) == executed[k] for k in keys),
        },
    }
