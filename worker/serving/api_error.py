"""The API's errors: OpenAI-style ``{"error": {message, type, param, code}}`` bodies with a status and,
for retryable ones, ``Retry-After``; and the same answer as a bare ASGI response (for middlewares,
which run before FastAPI's exception handlers).

What a client reads never holds internals: an engine failure (whose text may carry Ray's OOM
report or node ids) and an unexpected exception are logged with a short error id, and the answer
names only that id.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .engine_client import EngineDead, NoReadyEngine

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the API reports as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


ErrorSink = Callable[[ApiError], None]  # told of every error answered (metrics count them by code)


def ignore(_error: ApiError) -> None:
    return None


async def send_error(send: Callable[[dict[str, Any]], Awaitable[None]], error: ApiError, close: bool = False,
                     extra_headers: dict[str, str] | None = None, sink: ErrorSink = ignore) -> None:
    """``error`` as a whole ASGI response; ``close`` ends the connection after it."""
    sink(error)
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in {**error.headers(), **(extra_headers or {})}.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


NO_ENGINE_RETRY_S = 5
ENGINE_FAILED_RETRY_S = 1


def error_id() -> str:
    return uuid.uuid4().hex[:12]


def engine_unavailable(e: EngineDead) -> ApiError:
    """A 503 a client can act on (retry), without what the engine's failure says (that goes to the log)."""
    if isinstance(e, NoReadyEngine):
        return ApiError(503, "no ready engine groups; retry later", type="service_unavailable",
                        code="no_ready_engine", retry_after=NO_ENGINE_RETRY_S)
    eid = error_id()
    log.warning("the engine failed under a request (error id %s): %s", eid, e)
    return ApiError(503, f"the engine is unavailable: it failed while serving this request; retry it (error id {eid})",
                    type="service_unavailable", code="engine_dead", retry_after=ENGINE_FAILED_RETRY_S)


def internal_error(exc: BaseException) -> ApiError:
    eid = error_id()
    log.error("internal error (error id %s)", eid, exc_info=exc)
    return ApiError(500, f"internal server error (error id {eid})", type="server_error", code="internal_error")


def validation_message(exc: Any) -> tuple[str, str | None]:
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
