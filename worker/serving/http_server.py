"""Serve an ASGI app with uvicorn on a background thread (tests, ``fusedserve run``).

    server = HttpServer(build_app(client, metrics), port=0)  # 0 = a free port
    server.start()
    ... requests to server.url ...
    server.stop()

The socket is bound before the thread starts, so the port is known (and taken) at once.
Listens on 127.0.0.1 unless told otherwise (a pod that must be reached from outside passes
"0.0.0.0"). From ``ServingLimits``: a connection must send its request headers within
``header_timeout_s`` (408, ``http_protocol.py``), and beyond ``max_connections`` open
connections + requests in progress uvicorn answers 503. Draining the requests in flight is done
before ``stop`` (``drain.py``), so ``stop`` itself waits only briefly for connections to close.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from typing_extensions import Self

from ..spec import ServingLimits
from .http_protocol import with_header_timeout

log = logging.getLogger(__name__)


STOP_GRACE_S = 2  # uvicorn's graceful shutdown, after the drain


class HttpServerError(RuntimeError):
    """The server could not start (port taken, app failed to start up)."""


class HttpServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 access_log: bool = False, limits: ServingLimits | None = None) -> None:
        limits = limits or ServingLimits()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as e:
            self._socket.close()
            raise HttpServerError(f"cannot listen on {host}:{port}: {e}") from e
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                                http=with_header_timeout(limits.header_timeout_s),
                                limit_concurrency=limits.max_connections, timeout_graceful_shutdown=STOP_GRACE_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"fusedserve-http-{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000 (the OpenAI base URL is url + "/v1")."""
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as e:  # reported by start()
            self._error = e
            log.exception("HTTP server on port %d failed", self.port)

    def start(self, timeout: float = 30.0) -> Self:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise HttpServerError(f"the HTTP server on port {self.port} did not start: {self._error}")
            time.sleep(0.01)
        log.info("serving on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
