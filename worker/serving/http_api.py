"""The OpenAI-compatible HTTP API (FastAPI) over any ``EngineClient``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream``: ``data: {chunk}`` lines and a final ``data: [DONE]``), ``GET /v1/models``,
``/v1/models/{id}`` (404 for another id), vLLM's ``POST /tokenize`` / ``/detokenize`` and
``GET /version``, ``/health``, ``/status`` (the client's status as JSON) and ``/metrics`` (Prometheus text,
when a ``MetricsRegistry`` is given). Errors are OpenAI-style ``{"error": {message, type,
param, code}}``: 400 for a bad request (malformed JSON, wrong types, invalid or unsupported
parameters, too many sequences, a prompt or ``max_tokens`` beyond the context), 401 without
the API key, 404 for an unknown model or route, 408/413 for a slow or large body, 503 with
``Retry-After`` when no engine can take the request, the engine failed under it, or the server
is draining. A streamed request is checked before the first byte goes out (its first output is
awaited), so a refused one still gets a 4xx; a stream that fails later ends with an ``error``
event and ``[DONE]``. A client that goes away aborts its requests. Internal failures are
logged with an error id and answered with that id only (no exception text, no Ray reports).

Prompts are tokenised here (``prompt_tokenizer.py``), never on the engine thread; the engines
get token ids. Around the routes, outermost first: ``AccessMiddleware`` (API key),
``DrainMiddleware`` (shutdown), ``RequestBodyMiddleware`` (body size and timeouts).

    app = build_app(LocalEngineClient(engine), MetricsRegistry(labels), limits=rc.limits,
                    access=ApiAccess(api_key), drain=Drain(rc.limits.drain_grace_s))
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.outputs import RequestOutput
from ..engine.sequence import GrammarSpec, InvalidRequest
from ..engine.tokenizer import Tokenizer, TokenizerError
from ..spec import ServingLimits
from .access import AccessMiddleware, ApiAccess
from .api_error import engine_unavailable, internal_error, validation_message
from .drain import Drain, DrainMiddleware
from .engine_client import EngineClient, EngineDead
from .metrics import MetricsRegistry, package_version
from .openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest, _GenerationRequest
from .openai_response import ChatShape, Choice, CompletionShape, usage
from .output_streams import close_all, disconnected, merge
from .prompt_tokenizer import PromptTokenizer
from .request_body import RequestBodyMiddleware
from .request_limits import check_sequences, max_tokens_for
from .status_view import public_status
from .tokenize_protocol import DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions
UNLIMITED_MAX_TOKENS = 2**31 - 1  # chat without max_tokens: until a stop or the context ends


def _response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Api:
    def __init__(self, client: EngineClient, metrics: MetricsRegistry | None, limits: ServingLimits,
                 access: ApiAccess, drain: Drain | None) -> None:
        self.client = client
        self.metrics = metrics
        self.limits = limits
        self.access = access
        self.drain = drain
        self.tokens = PromptTokenizer(client.load_tokenizer)

    def count(self, err: ApiError) -> None:
        """Every error answered passes here (counted by code)."""
        if self.metrics is not None:
            self.metrics.count_error(err.code or "invalid_request")

    def response(self, err: ApiError) -> JSONResponse:
        self.count(err)
        return _response(err)

    def event(self, err: ApiError) -> str:
        self.count(err)
        return _sse(err.body())

    # --- running requests ------------------------------------------------------------------------

    def _check_model(self, body: _GenerationRequest | TokenizeRequest | DetokenizeRequest) -> str:
        name = self.client.model_name
        if body.model is not None and body.model != name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        return name

    def _start(self, prompts: list[list[int]], body: _GenerationRequest, max_tokens: list[int],
               request_id: str, grammar: GrammarSpec | None) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per (prompt, choice); choice index = prompt index * n + choice."""
        streams: list[AsyncIterator[RequestOutput]] = []
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                try:
                    params = body.sampling_params(max_tokens[p], i, grammar)
                except InvalidRequest as e:
                    raise ApiError(400, str(e), code="invalid_parameter") from e
                # a response sent whole needs the request's end only: nothing per step crosses to here
                stream = self.client.generate(prompt, params, f"{request_id}-{p * body.n + i}",
                                              final_only=not body.stream)
                streams.append(self.metrics.track(stream) if self.metrics is not None else stream)
        return streams

    @staticmethod
    async def _first(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Every request's first output (so a refused request fails before anything is sent)."""
        results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await close_all(streams)
            error = errors[0]
            if isinstance(error, InvalidRequest):
                raise ApiError(400, str(error), code="invalid_prompt") from error
            if isinstance(error, EngineDead):
                raise engine_unavailable(error) from error
            if isinstance(error, StopAsyncIteration):
                raise internal_error(RuntimeError("the engine ended a request without output"))
            raise error
        return [r for r in results if isinstance(r, RequestOutput)]

    async def _collect(self, streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[Choice]:
        """Run the requests to their end; abort them if the client disconnects first (also while the
        first outputs are awaited: a request sent whole has only its last one)."""
        choices = [Choice() for _ in streams]

        async def run() -> None:
            try:
                firsts = await self._first(streams)
            except asyncio.CancelledError:
                await close_all(streams)
                raise
            await self._drain(streams, firsts, choices)

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(disconnected(request))
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
            raise engine_unavailable(e) from e
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # this handler itself is being cancelled
            raise ApiError(499, "the client closed the request", code="client_closed") from None
        return choices

    @staticmethod
    async def _drain(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                     choices: list[Choice]) -> None:
        try:
            async for index, out in merge(streams, firsts):
                choices[index].apply(out)
        finally:
            await close_all(streams)

    # --- responses -------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        model = self._check_model(body)
        body.check()
        grammar = body.grammar()
        prompts = body.prompts()
        check_sequences(len(prompts), body.n, self.limits.max_sequences_per_request)
        max_len = self.client.max_model_len
        ids = await asyncio.gather(*(self.tokens.prompt_ids(p, max_len) for p in prompts))
        max_tokens = [max_tokens_for(len(i), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, max_len) for i in ids]
        texts = ([p if isinstance(p, str) else await self.tokens.decode(list(p), param="prompt") for p in prompts]
                 if body.echo else [])
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        shape = CompletionShape(rid, created, model, body.n, body.logprobs, body.echo, texts, list(ids),
                                body.prompt_logprobs is not None)
        streams = self._start(list(ids), body, max_tokens, rid, grammar)
        if body.stream:
            firsts = await self._first(streams)
            return self._stream(streams, firsts, body, shape, "text_completion", None)
        choices = await self._collect(streams, request)
        return JSONResponse(shape.body(choices, await self._texts(shape, choices, body)))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        model = self._check_model(body)
        body.check()
        grammar = body.grammar()
        check_sequences(1, body.n, self.limits.max_sequences_per_request)
        max_len = self.client.max_model_len
        ids = await self.tokens.chat_ids(body.conversation(), max_len)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = max_tokens_for(len(ids), body.requested_max_tokens(), None, max_len, param, UNLIMITED_MAX_TOKENS)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        shape = ChatShape(rid, created, model, body.n, bool(body.logprobs), body.prompt_logprobs is not None)
        streams = self._start([ids], body, [max_tokens], rid, grammar)
        if body.stream:
            firsts = await self._first(streams)
            return self._stream(streams, firsts, body, shape, "chat.completion.chunk", shape.opening)
        choices = await self._collect(streams, request)
        return JSONResponse(shape.body(choices, await self._texts(shape, choices, body)))

    async def _texts(self, shape: CompletionShape | ChatShape, choices: list[Choice],
                     body: _GenerationRequest) -> dict[int, str]:
        needed = sorted({t for i, c in enumerate(choices) for t in shape.needs(c, i)})
        return await self.token_texts(needed, body)

    async def token_texts(self, ids: list[int], body: _GenerationRequest) -> dict[int, str]:
        if body.return_tokens_as_token_ids:
            return {i: f"token_id:{i}" for i in ids}
        return await self.tokens.token_texts(ids)

    def _stream(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                body: _GenerationRequest, shape: CompletionShape | ChatShape, obj: str,
                opening: Any) -> StreamingResponse:
        choices = [Choice() for _ in streams]
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
                async for index, out in merge(streams, firsts):
                    choice = choices[index]
                    choice.apply(out)
                    reason = out.finish_reason.value if out.finished and out.finish_reason else None
                    # A chunk for every step that produced tokens (vLLM's rule), even when the text
                    # delta is empty (a partial character held back, or a deployment without tokenizer).
                    if out.new_token_ids or out.text_delta or reason:
                        texts = await self.token_texts(shape.chunk_needs(index, choice, out), body)
                        yield emit(shape.chunk(index, choice, out, reason, texts))
                if include_usage:
                    yield _sse({"id": shape.rid, "object": obj, "created": shape.created, "model": shape.model,
                                "choices": [], "usage": usage(choices, body.n)})
            except EngineDead as e:
                yield self.event(engine_unavailable(e))
            except Exception as e:  # noqa: BLE001 (the stream has started: end it with an error event)
                yield self.event(internal_error(e))
            finally:
                await close_all(streams)
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- the rest --------------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            conversation = body.conversation()
            special = bool(body.add_special_tokens)

            def encode(t: Tokenizer) -> list[int]:
                try:
                    text = t.apply_chat_template(conversation, add_generation_prompt=body.add_generation_prompt)
                except TokenizerError as e:
                    raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
                return t.encode(text, add_special_tokens=special)

            ids = await self.tokens.on_lane(encode, "messages", sum(len(m["content"]) for m in conversation))
        else:
            prompt, special = body.prompt or "", body.add_special_tokens is not False
            ids = await self.tokens.on_lane(lambda t: t.encode(prompt, add_special_tokens=special), "prompt",
                                            len(prompt))
        strs = None
        if body.return_token_strs:
            strs = await self.tokens.on_lane(lambda t: list(t.hf.convert_ids_to_tokens(ids)), "prompt")
        return {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body)
        return {"prompt": await self.tokens.decode(body.tokens, skip_special_tokens=False)}

    async def status(self) -> dict[str, Any]:
        """The client's status; ``ready`` false while draining; internals only for those who may see them."""
        try:
            doc = dict(await self.client.status())
        except EngineDead as e:
            raise engine_unavailable(e) from e
        if self.drain is not None and self.drain.draining:
            doc["ready"], doc["draining"] = False, True
        return doc if self.access.full_status else dict(public_status(doc))

    async def health(self) -> JSONResponse:
        if self.drain is not None and self.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        try:
            ready = bool((await self.client.status()).get("ready", False))
        except EngineDead:
            ready = False
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)


def is_work(path: str) -> bool:
    """Requests that run (or list) models: refused while draining, ended when the grace period ends."""
    return path.startswith("/v1/")


def build_app(client: EngineClient, metrics: MetricsRegistry | None = None, *, limits: ServingLimits | None = None,
              access: ApiAccess | None = None, drain: Drain | None = None) -> FastAPI:
    """The API app over ``client``; ``/metrics`` is served when ``metrics`` is given."""
    limits = limits or ServingLimits()
    access = access or ApiAccess()
    api = _Api(client, metrics, limits, access, drain)
    app = FastAPI(title="fusedserve", description="OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.api = api
    app.add_middleware(RequestBodyMiddleware, max_bytes=limits.max_request_bytes,
                       body_timeout_s=limits.body_timeout_s, send_timeout_s=limits.send_timeout_s, sink=api.count)
    if drain is not None:
        app.add_middleware(DrainMiddleware, drain=drain, guarded=is_work, sink=api.count)
    app.add_middleware(AccessMiddleware, access=access, sink=api.count)

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return api.response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return api.response(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        route = exc.status_code in (404, 405)
        message = f"no route {request.method} {request.url.path}" if route else str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return api.response(ApiError(exc.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return api.response(internal_error(exc))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    def card() -> dict[str, Any]:
        return {"id": client.model_name, "object": "model", "created": 0, "owned_by": "fusedserve",
                "root": client.model_name, "parent": None, "max_model_len": client.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != client.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await api.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await api.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/health")
    async def health() -> JSONResponse:
        return await api.health()

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
