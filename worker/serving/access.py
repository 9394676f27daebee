"""Who may call what: the API key (a Bearer token) and how much ``/status`` tells.

With a key (``fusedserve run --api-key`` or ``$FUSEDSERVE_API_KEY``) every route needs
``Authorization: Bearer <key>`` — ``/v1/*``, ``/status``, unknown paths too (a 401, not a 404,
so routes are not probed) — except ``/health`` and ``/metrics`` while ``spec.serving.auth``
leaves them ``public`` (kubelet probes and Prometheus carry no key). The comparison takes the
same time whatever the key sent (``hmac.compare_digest`` over SHA-256 digests, so not even the
length leaks).

``/status`` lists rank PIDs, node addresses and failure texts. Key holders see all of it. Without
a key configured, ``status_details`` says whether anyone may (``fusedserve run`` allows it only
when it listens on loopback); otherwise callers get ``status_view.public_status``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .api_error import ApiError, ErrorSink, ignore, send_error

log = logging.getLogger(__name__)

API_KEY_ENV = "FUSEDSERVE_API_KEY"


@dataclass(frozen=True)
class ApiAccess:
    api_key: str | None = None
    health_needs_key: bool = False
    metrics_needs_key: bool = False
    status_details: bool = True  # without a key: /status shows PIDs, node addresses, failure texts

    def __repr__(self) -> str:  # never print the key
        return (f"ApiAccess(api_key={'set' if self.api_key else None}, health_needs_key={self.health_needs_key}, "
                f"metrics_needs_key={self.metrics_needs_key}, status_details={self.status_details})")

    def needs_key(self, path: str) -> bool:
        if self.api_key is None:
            return False
        if path == "/health":
            return self.health_needs_key
        if path == "/metrics":
            return self.metrics_needs_key
        return True

    @property
    def full_status(self) -> bool:
        """Whether ``/status`` answers with every detail (its callers hold the key, or may see them anyway)."""
        return self.api_key is not None or self.status_details


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def unauthorized() -> ApiError:
    return ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key")


class AccessMiddleware:
    """ASGI: refuses (401) a request to a route that needs the key when it does not carry it."""

    def __init__(self, app: Any, access: ApiAccess, sink: ErrorSink = ignore) -> None:
        self.app = app
        self.access = access
        self.sink = sink
        self._key = _digest(access.api_key.encode()) if access.api_key else b""

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http" and self.access.needs_key(scope["path"]):
            token = bearer_token(scope.get("headers", []))
            matches = hmac.compare_digest(_digest(token or b""), self._key)
            if token is None or not matches:
                await send_error(send, unauthorized(), extra_headers={"WWW-Authenticate": "Bearer"}, sink=self.sink)
                return
        await self.app(scope, receive, send)
