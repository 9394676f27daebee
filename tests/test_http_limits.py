"""Bounded cost per request (issue 18): every hostile request of the 2026-12-01 adversarial run gets a
clear 4xx in bounded time while a small request beside it still finishes in < 2 s.

Before: a 20 MB prompt was tokenised on the engine thread (31 s; a 4-token request waited 28 s),
``{"prompt": ["x"]*256, "n": 64}`` ran 16 384 sequences, ``max_tokens`` 10^12 ran to the end of the
context, a 100 MB body was read, half a body or a Content-Length larger than the body held a
request forever. A real uvicorn server on 127.0.0.1 and the tiny code model (CPU) behind
LocalEngineClient; raw sockets for what no client library sends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient
from fusedserve.worker.serving.metrics import MetricsRegistry
from fusedserve.worker.serving.request_body import RequestBodyMiddleware, SlowClient
from fusedserve.worker.spec import ServingLimits

MODEL_DIR = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
MAX_MODEL_LEN = 256
LIMITS = ServingLimits(header_timeout_s=1.0, body_timeout_s=1.0)  # the rest: the defaults of spec.serving
SMALL = {"prompt": "def fib(n):", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[HttpServer, LocalEngineClient]]:
    engine = Engine(MODEL_DIR, EngineConfig(num_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                            max_batch_tokens=512, dtype="float32", seed=0))
    client = LocalEngineClient(engine, model_name="tiny-code")
    with HttpServer(build_app(client, MetricsRegistry(), limits=LIMITS), limits=LIMITS) as srv:
        yield srv, client
    client.close()


def post(url: str, body: Any, path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    return dict(r.json()["error"])


class SmallRequests:
    """A 4-token completion after another, beside whatever the test does; their latencies.

    ``bound`` is the issue's 2 s, unless the machine is so loaded that small requests alone (the
    baseline, measured first) are slow: then 10x the baseline's median. A request that waits for a
    hostile one's tokenisation, as before (28 s for a 20 MB prompt), exceeds either by far."""

    def __init__(self, url: str, baseline_s: float = 1.0) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        baseline = []
        deadline = time.monotonic() + baseline_s
        while time.monotonic() < deadline or len(baseline) < 5:
            t0 = time.monotonic()
            post(url, SMALL).raise_for_status()
            baseline.append(time.monotonic() - t0)
        self.bound = max(2.0, 10 * statistics.median(baseline))

    def check(self) -> None:
        assert self.failures == [] and self.latencies, (self.failures, self.latencies)
        assert max(self.latencies) < self.bound, (self.latencies, self.bound)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            r = post(self.url, SMALL)
            self.latencies.append(time.monotonic() - t0)
            if r.status_code != 200:
                self.failures.append(r.text)

    def __enter__(self) -> SmallRequests:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


def test_hostile_requests_get_4xx_in_bounded_time_while_a_small_request_finishes(server: Any) -> None:
    srv, _ = server
    url = srv.url
    twenty_mb = b"x" * (20 << 20)

    def chunked() -> Iterator[bytes]:
        for _ in range(20):
            yield b"y" * (1 << 20)

    with SmallRequests(url) as small:
        cases: list[tuple[str, Any, int, str]] = [
            ("20 MB body", lambda: post(url, twenty_mb), 413, "request_too_large"),
            ("20 MB chunked body", lambda: httpx.post(url + "/v1/completions", content=chunked(), timeout=30),
             413, "request_too_large"),
            ("6 MB prompt", lambda: post(url, {"prompt": "def f(x):\n" * 600_000, "max_tokens": 4}), 400,
             "context_length_exceeded"),
            ("256 prompts x n=64", lambda: post(url, {"prompt": ["x"] * 256, "n": 64, "max_tokens": 1}), 400,
             "too_many_sequences"),
            ("max_tokens 10^12", lambda: post(url, {"prompt": "x", "max_tokens": 10**12}), 400,
             "context_length_exceeded"),
            ("chat max_completion_tokens 10^12",
             lambda: post(url, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**12},
                          "/v1/chat/completions"), 400, "context_length_exceeded"),
            ("prompt ids beyond the context", lambda: post(url, {"prompt": [5] * (MAX_MODEL_LEN + 10)}), 400,
             "context_length_exceeded"),
        ]
        for name, send, status, code in cases:
            r, seconds = timed(send)
            err = error_of(r, status)
            assert err["code"] == code, (name, err)
            assert seconds < 2.5 * small.bound, (name, seconds)  # 5 s, more on a machine too loaded for that
        time.sleep(0.5)
    small.check()
    errors = {s.labels["code"]: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              for s in fam.samples if s.name == "fusedserve_api_errors_total"}
    assert errors.get("request_too_large", 0) >= 2 and errors.get("too_many_sequences", 0) >= 1, errors
    assert errors.get("context_length_exceeded", 0) >= 4, errors


def test_max_tokens_defaults_to_what_the_context_leaves_and_an_explicit_one_must_fit(server: Any) -> None:
    srv, _ = server
    prompt = [5] * (MAX_MODEL_LEN - 3)
    r = post(srv.url, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    err = error_of(post(srv.url, {"prompt": prompt, "max_tokens": 4}), 400)
    assert err["param"] == "max_tokens" and "at most 3" in err["message"] and "max_model_len" in err["message"]
    chat = post(srv.url, {"messages": [{"role": "user", "content": "x " * 40}], "temperature": 0, "ignore_eos": True},
                "/v1/chat/completions")  # no max_tokens: to the end of the context
    usage = chat.json()["usage"]
    assert chat.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


def test_the_engine_is_handed_token_ids_only(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenising is the HTTP process's job (its own threads): the engine thread never gets text."""
    srv, client = server
    seen: list[Any] = []
    real = client.generate

    def recording(prompt: Any, params: Any, request_id: str, **kw: Any) -> Any:
        seen.append(prompt)
        return real(prompt, params, request_id, **kw)

    monkeypatch.setattr(client, "generate", recording)
    assert post(srv.url, SMALL).status_code == 200
    assert post(srv.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                "/v1/chat/completions").status_code == 200
    assert len(seen) == 2 and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in seen)


def _raw(port: int, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes (or ``wait`` s pass): (answer, seconds)."""
    # The clock starts before connecting: the server's header timer starts when it accepts the connection,
    # which may come before connect() returns here (a fresh clone's CI measured 0.997 s for a 1 s timeout).
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks), time.monotonic() - t0


def test_half_a_body_and_a_content_length_larger_than_the_body_get_408(server: Any) -> None:
    srv, _ = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    answer, seconds = _raw(srv.port, head + b'{"prompt": "' + b"a" * 400, wait=10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]
    assert LIMITS.body_timeout_s <= seconds < LIMITS.body_timeout_s + 3


def test_a_connection_must_send_its_headers_in_time(server: Any) -> None:
    srv, _ = server
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        answer, seconds = _raw(srv.port, partial, wait=10)
        assert answer.startswith(b"HTTP/1.1 408") and b"headerTimeoutSeconds" in answer, answer[:300]
        assert LIMITS.header_timeout_s <= seconds < LIMITS.header_timeout_s + 3


def test_fifty_slow_clients_are_all_answered_and_hold_nobody_up(server: Any) -> None:
    """The adversarial run's 50 clients that send half a body: each gets its 408; small requests go on."""
    srv, _ = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(50)]
    try:
        with SmallRequests(srv.url) as small:
            for s in socks:
                s.sendall(head)
            answers = [s.recv(4096) for s in socks]
            time.sleep(0.3)
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:20] for a in answers}
    finally:
        for s in socks:
            s.close()
    small.check()


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout() -> None:
    """A response chunk nobody takes (a full socket buffer) ends the request instead of holding it."""
    ended: list[BaseException] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        except SlowClient as e:
            ended.append(e)
            raise

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def stuck_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the client reads nothing

    middleware = RequestBodyMiddleware(app, max_bytes=1024, body_timeout_s=1, send_timeout_s=0.2)
    t0 = time.monotonic()
    asyncio.run(middleware({"type": "http", "headers": []}, receive, stuck_send))
    assert len(ended) == 1 and time.monotonic() - t0 < 2
