"""Draining on shutdown (issue 18): every request in flight gets a result or a well-formed error.

Before: SIGTERM with requests in flight gave the 4 non-streaming ones ``500 Internal Server Error``
as text/plain and cut the 4 streams with neither an error event nor ``[DONE]`` (uvicorn's 5 s
graceful timeout, no drain). Here ``Drain.shutdown`` is what ``fusedserve run`` calls on SIGTERM
(tests/test_ray_runtime.py sends the real signal); the engine is the tiny code model, each step made
20 ms slower so that long requests outlast a short grace period.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.serving.drain import FLUSH_S, Drain
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient

MODEL_DIR = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
GRACE_S = 3.0
LONG = {"prompt": "def long(", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "def short(", "max_tokens": 3, "temperature": 0}


class SlowEngine:
    """The real engine, each step 20 ms slower."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def step(self) -> Any:
        time.sleep(0.02)
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def client() -> Iterator[LocalEngineClient]:
    engine = Engine(MODEL_DIR, EngineConfig(num_blocks=128, max_model_len=256, max_num_seqs=16, max_batch_tokens=512,
                                            dtype="float32", seed=0))
    c = LocalEngineClient(SlowEngine(engine), model_name="tiny-code")  # type: ignore[arg-type]
    yield c
    c.close()


def running(url: str) -> int:
    group = httpx.get(url + "/status", timeout=10).json()["groups"][0]
    return int(group["num_requests_running"]) + int(group["num_requests_waiting"])


def sse_events(r: httpx.Response) -> list[Any]:
    return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_drain_ends_every_request_in_flight_with_a_result_or_a_well_formed_error(client: LocalEngineClient) -> None:
    drain = Drain(grace_s=GRACE_S)
    results: dict[str, Any] = {}

    with HttpServer(build_app(client, drain=drain)) as server:
        url = server.url + "/v1/completions"

        def plain(name: str, body: dict[str, Any]) -> None:
            results[name] = httpx.post(url, json=body, timeout=60)

        def stream(name: str) -> None:
            with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
                results[name] = (r.status_code, r.headers.get("content-type"), sse_events(r))

        threads = [threading.Thread(target=plain, args=(f"short{i}", SHORT)) for i in range(2)]
        threads += [threading.Thread(target=plain, args=(f"long{i}", LONG)) for i in range(4)]
        threads += [threading.Thread(target=stream, args=(f"stream{i}",)) for i in range(4)]
        for t in threads[2:]:
            t.start()
        deadline = time.monotonic() + 30
        while running(server.url) < 8:
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.05)
        for t in threads[:2]:  # short requests that finish inside the grace period
            t.start()
        while drain.in_flight() < 10:
            assert time.monotonic() < deadline, "the short requests were not admitted"
            time.sleep(0.01)

        t0 = time.monotonic()
        shutdown = threading.Thread(target=lambda: results.update(ended=drain.shutdown()))
        shutdown.start()
        time.sleep(0.2)
        # readiness is false at once; new work is refused with a retryable 503
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(url, json=SHORT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert refused.headers["Retry-After"] == "1" and refused.headers["connection"] == "close"
        assert httpx.get(server.url + "/status", timeout=10).json()["draining"] is True

        for t in threads:
            t.join(timeout=60)
        shutdown.join(timeout=60)
        assert time.monotonic() - t0 < GRACE_S + FLUSH_S + 5  # + scheduling slack on a loaded machine
        assert results["ended"] == 8

    for i in range(2):  # finished in the grace period: a normal answer
        r = results[f"short{i}"]
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    for i in range(4):  # still running at its end: a JSON 503, not text/plain
        r = results[f"long{i}"]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "shutting_down" and r.headers["Retry-After"] == "1"
    for i in range(4):  # streams: tokens, then an error event and [DONE]
        status, kind, events = results[f"stream{i}"]
        assert status == 200 and kind.startswith("text/event-stream")
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
        assert any("choices" in json.loads(e) for e in events[:-2])
    # the engine requests of the ended ones were aborted
    deadline = time.monotonic() + 10
    while client.engine.has_unfinished():
        assert time.monotonic() < deadline, "requests ended by the drain still run in the engine"
        time.sleep(0.05)


def test_a_drain_with_nothing_left_at_the_end_ends_nothing(client: LocalEngineClient) -> None:
    drain = Drain(grace_s=30)
    with HttpServer(build_app(client, drain=drain)) as server:
        done: list[httpx.Response] = []
        t = threading.Thread(target=lambda: done.append(httpx.post(server.url + "/v1/completions", json=SHORT,
                                                                   timeout=60)))
        t.start()
        deadline = time.monotonic() + 10
        while drain.in_flight() == 0 and not done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        assert drain.shutdown() == 0  # returns as soon as the request finished, long before 30 s
        assert time.monotonic() - t0 < 10
        t.join(timeout=10)
    assert done[0].status_code == 200
