"""The OpenAI-compatible API end to end: a real uvicorn server on 127.0.0.1, a real Engine on
examples/checkpoints/tiny-code (float32, CPU) behind LocalEngineClient, the real ``openai``
client, and httpx for what that client cannot send (malformed bodies, disconnects)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.scheduler import SchedulerStats
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.serving.engine_client import EngineDead
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient
from fusedserve.worker.serving.metrics import MetricsRegistry

MODEL_DIR = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
MODEL = "tiny-code"
MAX_MODEL_LEN = 256
PROMPT = "def fib(n):"


@dataclass
class Served:
    url: str
    client: LocalEngineClient
    oai: openai.OpenAI


def serve(overlap: bool = False) -> Iterator[Served]:
    engine = Engine(MODEL_DIR, EngineConfig(num_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                            max_batch_tokens=512, dtype="float32", seed=0,
                                            overlap_scheduling=overlap))
    client = LocalEngineClient(engine, {"deployment": "test", "engine_group": "0", "rank": "0"}, model_name=MODEL)
    server = HttpServer(build_app(client, MetricsRegistry(client.labels, MODEL))).start()
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield Served(server.url, client, oai)
    finally:
        server.stop()
        client.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve()


@pytest.fixture(scope="module")
def served_overlapped() -> Iterator[Served]:
    """The engine as on a GPU: overlapped steps (each step hands back the one before it)."""
    yield from serve(overlap=True)


def complete(s: Served, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    return s.oai.completions.create(**{**args, **kw})


def post(s: Served, path: str, body: Any, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(s.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


# --- discovery -------------------------------------------------------------------------------------


def test_models_health_status(served: Served) -> None:
    assert [m.id for m in served.oai.models.list().data] == [MODEL]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    status = httpx.get(served.url + "/status").json()
    assert status["ready"] is True and status["model"] == MODEL and status["max_model_len"] == MAX_MODEL_LEN
    [group] = status["groups"]
    assert group["labels"]["deployment"] == "test" and group["collectives"]["matches_plan"] is True


# --- completions and chat --------------------------------------------------------------------------


def test_completion_max_tokens_gives_length(served: Served) -> None:
    r = complete(served, max_tokens=6)
    [choice] = r.choices
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_streaming_assembles_to_the_same_text(served: Served) -> None:
    whole = complete(served, max_tokens=12)
    chunks = list(complete(served, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    *content, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_and_chat_streaming(served: Served) -> None:
    messages: Any = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fib"}]
    r = served.oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                           temperature=0)
    [choice] = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 10
    chunks: list[Any] = list(served.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                                temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(served: Served) -> None:
    full = complete(served, max_tokens=16).choices[0].text
    # A stop string from the middle of the greedy text: the text ends right before it.
    start = next(i for i in range(2, len(full) - 3)
                 if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i)
    stop = full[start:start + 3]
    for value in (stop, ["@@never@@", stop]):
        r = complete(served, max_tokens=16, stop=value)
        assert r.choices[0].text == full[:start] and r.choices[0].finish_reason == "stop"
    chunks = list(complete(served, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(served: Served) -> None:
    def sampled(seed: int) -> str:
        return str(complete(served, temperature=1.0, seed=seed, max_tokens=10).choices[0].text)

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


def test_n_choices_use_derived_seeds(served: Served) -> None:
    r = complete(served, n=3, temperature=1.0, seed=11, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert r.choices[0].text == complete(served, temperature=1.0, seed=11, max_tokens=6).choices[0].text
    assert r.choices[2].text == complete(served, temperature=1.0, seed=13, max_tokens=6).choices[0].text
    chunks = list(complete(served, n=2, temperature=1.0, seed=11, max_tokens=6, stream=True))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}


def test_token_id_and_batched_prompts(served: Served) -> None:
    by_text = complete(served, max_tokens=5)
    ids = served.client.engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    by_ids = complete(served, prompt=ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = complete(served, prompt=[PROMPT, "import os\n"], max_tokens=5)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 10


# --- bad requests ----------------------------------------------------------------------------------


def test_malformed_and_mistyped_bodies(served: Served) -> None:
    assert "JSON" in assert_error(post(served, "/v1/completions", b'{"prompt": "x",'), 400)["message"]
    assert_error(post(served, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(served, "/v1/completions", {"model": MODEL}), 400, "prompt")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "n": 0}), 400, "n")
    assert_error(post(served, "/v1/completions", {"prompt": "x", "stop": 5}), 400)
    assert_error(post(served, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(served, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400)


def test_invalid_and_unsupported_parameters(served: Served) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"suffix": "y"}, "suffix"), ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for extra, param in cases:
        err = assert_error(post(served, "/v1/completions", {"prompt": "x", **extra}), 400, param)
        assert param in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    assert_error(post(served, "/v1/chat/completions", chat), 400, "tools")
    with pytest.raises(openai.BadRequestError):
        complete(served, prompt="")  # no tokens
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        complete(served, prompt=[1, 2, 99999])


def test_unknown_model_and_routes(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        complete(served, model="gpt-4")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert_error(httpx.get(served.url + "/v1/nothing"), 404)
    assert_error(httpx.get(served.url + "/v1/completions"), 405)


def test_prompt_longer_than_the_context_is_refused(served: Served) -> None:
    ids = [5] * (MAX_MODEL_LEN + 10)
    start = time.monotonic()
    for stream in (False, True):
        r = post(served, "/v1/completions", {"prompt": ids, "max_tokens": 4, "stream": stream})
        assert "max_model_len" in assert_error(r, 400)["message"]
    assert time.monotonic() - start < 10


# --- aborts and a dead engine -----------------------------------------------------------------------


def wait_idle(s: Served, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        group = httpx.get(s.url + "/status").json()["groups"][0]
        if group["num_requests_running"] == 0 and group["num_requests_waiting"] == 0:
            return dict(group)
        assert time.monotonic() < deadline, f"requests still running: {group}"
        time.sleep(0.05)


def aborted(s: Served) -> float:
    for family in text_string_to_metric_families(httpx.get(s.url + "/metrics").text):
        if family.name == "fusedserve_request_success":
            return sum(x.value for x in family.samples if x.labels["finished_reason"] == "abort")
    raise AssertionError("no fusedserve_request_success_total")


def test_client_disconnect_aborts_the_request(served: Served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    start, aborts = time.monotonic(), aborted(served)
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_idle(served)
    with pytest.raises(httpx.ReadTimeout):
        post(served, "/v1/completions", body, timeout=0.5)
    wait_idle(served)
    assert aborted(served) == aborts + 2
    assert time.monotonic() - start < 8


def test_overlapped_engine_serves_the_same_text_streams_stops_seeds_and_aborts(
        served: Served, served_overlapped: Served) -> None:
    assert served_overlapped.client.engine.overlap and not served.client.engine.overlap
    for kw in ({"max_tokens": 12}, {"max_tokens": 10, "temperature": 1.0, "seed": 7},
               {"max_tokens": 8, "logprobs": 2}, {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 6}):
        a, b = complete(served, **kw), complete(served_overlapped, **kw)
        assert [(c.text, c.finish_reason) for c in a.choices] == [(c.text, c.finish_reason) for c in b.choices]
        assert a.usage.completion_tokens == b.usage.completion_tokens
    full = complete(served, max_tokens=16).choices[0].text
    stop = full[4:7]
    chunks = list(complete(served_overlapped, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == complete(served, max_tokens=16, stop=stop).choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    test_client_disconnect_aborts_the_request(served_overlapped)


def test_idle_engine_thread_sleeps(served: Served) -> None:
    complete(served, max_tokens=2)
    wait_idle(served)
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1  # no busy loop while nothing is pending


class _BrokenEngine:
    """Enough of an Engine for LocalEngineClient: it accepts a request and its step fails."""

    tokenizer = None
    max_model_len = 64

    def __init__(self) -> None:
        self.pending = False

    def collective_ledger(self) -> None:
        return None

    def add_request(self, prompt: Any, params: Any, request_id: str) -> str:
        self.pending = True
        return request_id

    def has_unfinished(self) -> bool:
        return self.pending

    def step(self) -> list[Any]:
        raise RuntimeError("a rank died")

    def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 1, 1, 0)


def test_dead_engine_gives_503_with_an_error_id_and_no_internals(caplog: pytest.LogCaptureFixture) -> None:
    client = LocalEngineClient(_BrokenEngine(), model_name=MODEL)  # type: ignore[arg-type]
    with HttpServer(build_app(client, MetricsRegistry())) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
        err = assert_error(r, 503)
        assert err["code"] == "engine_dead" and r.headers["Retry-After"] == "1"
        # the reason (it may be a Ray OOM report, node ids) is in the log under the id the client got, not in the body
        assert "a rank died" not in r.text and "RuntimeError" not in r.text
        match = re.search(r"error id ([0-9a-f]{12})", err["message"])
        assert match, err
        assert any(match.group(1) in rec.getMessage() and "a rank died" in rec.getMessage() for rec in caplog.records)
        assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": [1]}, timeout=30), 503)
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.get(server.url + "/status").json()["ready"] is False
        assert httpx.get(server.url + "/metrics").status_code == 200
    client.close()

    async def generate_after_close() -> None:
        async for _ in client.generate([1], SamplingParams(max_tokens=1), "late"):
            pass

    with pytest.raises(EngineDead, match="a rank died"):
        asyncio.run(generate_after_close())


def test_merged_outputs_keep_tokens_text_and_the_last_state() -> None:
    from fusedserve.worker.engine.outputs import RequestOutput, merge_outputs
    from fusedserve.worker.engine.sequence import FinishReason

    a = RequestOutput("r", [1, 2], "ab", False, None, 5, 2)
    b = RequestOutput("r", [3], "c", True, FinishReason.LENGTH, 5, 3)
    assert merge_outputs([a]) is a
    assert merge_outputs([a, b]) == RequestOutput("r", [1, 2, 3], "abc", True, FinishReason.LENGTH, 5, 3)


def test_an_engine_without_tokenizer_serves_token_ids_and_refuses_text_with_400() -> None:
    """``model.skipTokenizer`` (main) behind the HTTP-side tokenizer (reliability): no tokenizer is loaded,
    token-id prompts are served (a stream chunk for every step, its text empty), text and chat get 400."""
    engine = Engine(MODEL_DIR, EngineConfig(num_blocks=32, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                                            max_batch_tokens=256, dtype="float32", seed=0, skip_tokenizer=True))
    client = LocalEngineClient(engine, model_name=MODEL)
    assert client.load_tokenizer() is None
    try:
        with HttpServer(build_app(client, MetricsRegistry())) as server:
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 1 + 4  # one chunk per token, then [DONE]
            for path, text_body in (("/v1/completions", {"model": MODEL, "prompt": "def f():", "max_tokens": 2}),
                                    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})):
                err = assert_error(httpx.post(server.url + path, json=text_body, timeout=30), 400)
                assert err["code"] == "invalid_prompt" and "token ids only" in err["message"], err
    finally:
        client.close()
