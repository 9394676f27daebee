"""The OpenAI-compatible HTTP API (FastAPI) over any ``EngineClient``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream``: ``data: {chunk}`` lines and a final ``data: [DONE]``), ``GET /v1/models``,
``/health``, ``/status`` (the client's status as JSON) and ``/metrics`` (Prometheus text,
when a ``MetricsRegistry`` is given). Errors are OpenAI-style ``{"error": {message, type,
param, code}}``: 400 for a bad request (malformed JSON, wrong types, invalid or unsupported
parameters, a prompt the engine refuses), 404 for an unknown model or route, 503 when the
engine is dead. A streamed request is checked before the first byte goes out (its first
output is awaited), so a refused one still gets a 4xx. A client that goes away aborts its
requests.

    app = build_app(LocalEngineClient(engine), MetricsRegistry(labels))
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.outputs import RequestOutput
from ..engine.sequence import InvalidRequest
from .engine_client import EngineClient, EngineDead
from .metrics import MetricsRegistry
from .openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest, _GenerationRequest

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions
UNLIMITED_MAX_TOKENS = 2**31 - 1  # chat without max_tokens: until a stop or the context ends


@dataclass
class _Choice:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _dead(e: EngineDead) -> ApiError:
    return ApiError(503, f"the engine is unavailable: {e}", type="service_unavailable", code="engine_dead")


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Api:
    def __init__(self, client: EngineClient, metrics: MetricsRegistry | None) -> None:
        self.client = client
        self.metrics = metrics

    # --- running requests ------------------------------------------------------------------------

    def _check_model(self, body: _GenerationRequest) -> str:
        name = self.client.model_name
        if body.model is not None and body.model != name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        return name

    def _start(self, prompts: list[str | list[int]], body: _GenerationRequest, max_tokens: int,
               request_id: str) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per (prompt, choice); choice index = prompt index * n + choice."""
        streams: list[AsyncIterator[RequestOutput]] = []
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                try:
                    params = body.sampling_params(max_tokens, i)
                except InvalidRequest as e:
                    raise ApiError(400, str(e), code="invalid_parameter") from e
                stream = self.client.generate(prompt, params, f"{request_id}-{p * body.n + i}")
                streams.append(self.metrics.track(stream) if self.metrics is not None else stream)
        return streams

    @staticmethod
    async def _first(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Every request's first output (so a refused request fails before anything is sent)."""
        results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await _close_all(streams)
            error = errors[0]
            if isinstance(error, InvalidRequest):
                raise ApiError(400, str(error), code="invalid_prompt") from error
            if isinstance(error, EngineDead):
                raise _dead(error) from error
            if isinstance(error, StopAsyncIteration):
                raise ApiError(500, "the engine ended a request without output", type="server_error")
            raise error
        return [r for r in results if isinstance(r, RequestOutput)]

    async def _collect(self, streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[_Choice]:
        """Run the requests to their end; abort them if the client disconnects first."""
        firsts = await self._first(streams)
        choices = [_Choice() for _ in streams]
        work = asyncio.ensure_future(self._drain(streams, firsts, choices))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                log.info("client went away; aborting %d request(s)", len(streams))
        try:
            await work
        except EngineDead as e:
            raise _dead(e) from e
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # this handler itself is being cancelled
            raise ApiError(499, "the client closed the request", code="client_closed") from None
        return choices

    @staticmethod
    async def _drain(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                     choices: list[_Choice]) -> None:
        try:
            async for index, out in _merge(streams, firsts):
                _apply(choices[index], out)
        finally:
            await _close_all(streams)

    # --- responses -------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        model = self._check_model(body)
        body.check()
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = self._start(body.prompts(), body, max_tokens, rid)

        def chunk(index: int, text: str, reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            firsts = await self._first(streams)
            return self._stream(streams, firsts, body, rid, created, model, "text_completion", chunk, None)
        choices = await self._collect(streams, request)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)],
            "usage": _usage(choices, body.n),
        })

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        model = self._check_model(body)
        body.check()
        try:
            prompt = self.client.apply_chat_template(body.conversation())
        except InvalidRequest as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
        max_tokens = body.requested_max_tokens() or UNLIMITED_MAX_TOKENS
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = self._start([prompt], body, max_tokens, rid)

        def chunk(index: int, text: str, reason: str | None) -> dict[str, Any]:
            delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def opening(index: int) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}

        if body.stream:
            firsts = await self._first(streams)
            return self._stream(streams, firsts, body, rid, created, model, "chat.completion.chunk", chunk,
                                opening)
        choices = await self._collect(streams, request)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": _usage(choices, body.n),
        })

    def _stream(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                body: _GenerationRequest, rid: str, created: int, model: str, obj: str,
                chunk: Any, opening: Any) -> StreamingResponse:
        choices = [_Choice() for _ in streams]
        include_usage = body.include_usage

        def emit(payload: dict[str, Any]) -> str:
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        async def events() -> AsyncIterator[str]:
            try:
                if opening is not None:
                    for index in range(len(streams)):
                        yield emit(opening(index))
                async for index, out in _merge(streams, firsts):
                    _apply(choices[index], out)
                    reason = out.finish_reason.value if out.finished and out.finish_reason else None
                    # A chunk for every step that produced tokens (vLLM's rule), even when the text
                    # delta is empty (a partial character held back, or a deployment without tokenizer).
                    if out.new_token_ids or out.text_delta or reason:
                        yield emit(chunk(index, out.text_delta, reason))
                if include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": _usage(choices, body.n)})
            except EngineDead as e:
                yield _sse(_dead(e).body())
            finally:
                await _close_all(streams)
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- the rest --------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        try:
            return await self.client.status()
        except EngineDead as e:
            raise _dead(e) from e


def _apply(choice: _Choice, out: RequestOutput) -> None:
    choice.text += out.text_delta
    choice.prompt_tokens = out.num_prompt_tokens
    choice.completion_tokens = out.num_output_tokens
    if out.finished and out.finish_reason is not None:
        choice.finish_reason = out.finish_reason.value


def _usage(choices: list[_Choice], n: int) -> dict[str, int]:
    """Each prompt counts once (not once per choice); every choice's tokens count."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merge(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]
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


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except RuntimeError:  # still running in a task being cancelled; it closes itself
                pass


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return f"the request body is not valid JSON: {reason}", None
    if not loc:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    param = ".".join(loc)
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
             for e in errors[:5]]
    return "; ".join(parts), param


def build_app(client: EngineClient, metrics: MetricsRegistry | None = None) -> FastAPI:
    """The API app over ``client``; ``/metrics`` is served when ``metrics`` is given."""
    api = _Api(client, metrics)
    app = FastAPI(title="fusedserve", description="OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        route = exc.status_code in (404, 405)
        message = f"no route {request.method} {request.url.path}" if route else str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(exc.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in a request")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": client.model_name, "object": "model", "created": 0,
                                            "owned_by": "fusedserve"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        status = await api.status()
        ready = bool(status.get("ready", False))
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return await api.status()

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus() -> Response:
            try:
                snapshots = await client.metrics()
            except EngineDead:
                snapshots = []
            return Response(metrics.exposition(snapshots), media_type=CONTENT_TYPE_LATEST)

    return app
