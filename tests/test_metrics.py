"""Prometheus metrics: scraped over HTTP from a real server (tiny-code engine behind
LocalEngineClient) and parsed with prometheus-client's parser; counters must agree with what
the API returned. The exporter's handling of speculative and timing data is checked on
hand-made snapshots."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.serving.engine_client import SNAPSHOT_LABELS, HistogramData, MetricsSnapshot
from fusedserve.worker.serving.engine_stats import spec_snapshot
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient
from fusedserve.worker.serving.metrics import MetricsRegistry

MODEL_DIR = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
MODEL = "tiny-code"
LABELS = {"deployment": "demo", "namespace": "ml", "engine_group": "g0", "rank": "0", "tp_rank": "0", "dp_rank": "0",
          "ep_rank": "0"}


@dataclass
class Served:
    url: str
    oai: openai.OpenAI


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    config = EngineConfig(num_blocks=64, max_num_seqs=8, max_batch_tokens=512, dtype="float32")
    engine = Engine(MODEL_DIR, config)
    client = LocalEngineClient(engine, LABELS, model_name=MODEL)
    server = HttpServer(build_app(client, MetricsRegistry(LABELS, MODEL))).start()
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
        yield Served(server.url, oai)
    finally:
        server.stop()
        client.close()


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str) -> list[Sample]:
        """Samples named ``name`` exactly (e.g. ``fusedserve_forwards_total``, ``..._bucket``)."""
        return [s for f in self.families.values() for s in f.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples(name)
                   if all(s.labels.get(k) == v for k, v in labels.items()))


def scrape(url: str) -> Scrape:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


COUNTERS = ("fusedserve_prompt_tokens_total", "fusedserve_generation_tokens_total",
            "fusedserve_time_to_first_token_seconds_count", "fusedserve_e2e_request_latency_seconds_count",
            "fusedserve_inter_token_latency_seconds_count", "fusedserve_forwards_total")


def test_counters_agree_with_responses(served: Served) -> None:
    before = scrape(served.url)
    usages: list[Any] = []
    reasons: list[str] = []
    requests: list[dict[str, Any]] = [
        {"max_tokens": 5},
        {"max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
        {"max_tokens": 16, "stop": ["Return"]},
        {"max_tokens": 7, "temperature": 1.0, "seed": 3},
    ]
    for kw in requests:
        r: Any = served.oai.completions.create(model=MODEL, prompt="def fib(n):", **{"temperature": 0, **kw})
        if kw.get("stream"):
            chunks = list(r)
            reasons.append(chunks[-2].choices[0].finish_reason)
            usages.append(chunks[-1].usage)
        else:
            reasons.append(r.choices[0].finish_reason)
            usages.append(r.usage)
    chat = served.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
    reasons.append(chat.choices[0].finish_reason)
    usages.append(chat.usage)
    after = scrape(served.url)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    completion = sum(u.completion_tokens for u in usages)
    assert delta("fusedserve_generation_tokens_total") == completion
    assert delta("fusedserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert "stop" in reasons and "length" in reasons
    for reason in ("stop", "length", "abort"):
        assert delta("fusedserve_request_success_total", finished_reason=reason) == reasons.count(reason)
    # Request latencies: one TTFT and one end-to-end observation per request, one inter-token latency per
    # later engine step that produced tokens (a response sent whole arrives in one piece: its first token is
    # dated by the engine's decode time, before the end, and its gaps are the engine's between its steps).
    assert delta("fusedserve_time_to_first_token_seconds_count") == len(usages)
    assert delta("fusedserve_e2e_request_latency_seconds_count") == len(usages)
    assert usages[1].completion_tokens - 1 < delta("fusedserve_inter_token_latency_seconds_count") \
        <= completion - len(usages)
    assert delta("fusedserve_time_to_first_token_seconds_sum") < delta("fusedserve_e2e_request_latency_seconds_sum")
    assert delta("fusedserve_forwards_total") >= completion


def test_collectives_executed_equal_planned_times_forwards(served: Served) -> None:
    served.oai.completions.create(model=MODEL, prompt="import os", max_tokens=3, temperature=0)
    s = scrape(served.url)
    forwards = s.value("fusedserve_forwards_total", **LABELS)
    assert forwards > 0
    planned = {(x.labels["op"], x.labels["group"]): x.value
               for x in s.samples("fusedserve_collective_planned_calls_total")}
    executed: dict[tuple[str, str], float] = {}
    for x in s.samples("fusedserve_collective_calls_total"):
        key = (x.labels["op"], x.labels["group"])
        executed[key] = executed.get(key, 0) + x.value
    # tp=1: the plan has no collective and none ran (multi-rank plans are checked with the Ray runtime).
    assert executed == planned == {}
    assert "fusedserve_collective_calls" in s.families  # exported, with no series
    assert "fusedserve_collective_planned_calls" in s.families
    assert "fusedserve_collective_seconds" not in s.families  # the ledger does not time collectives
    assert httpx.get(served.url + "/status").json()["groups"][0]["collectives"]["matches_plan"] is True


def test_gauges_follow_a_running_request(served: Served) -> None:
    body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # dropping this iterator would close the connection (an abort)
        next(lines)
        s = scrape(served.url)
        assert s.value("fusedserve_num_requests_running", **LABELS) == 1
        assert s.value("fusedserve_num_requests_waiting", **LABELS) == 0
        assert 0 < s.value("fusedserve_kv_cache_usage_ratio", **LABELS) <= 1
    deadline = time.monotonic() + 10
    while (s := scrape(served.url)).value("fusedserve_num_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert s.value("fusedserve_kv_cache_usage_ratio") == 0


def test_prefix_cache_counters_count_tokens_looked_up_and_found(served: Served) -> None:
    system = "# Helpers: read the configuration file, open the database, format every reply.\nimport os\n\n"
    before = scrape(served.url)
    usages = [served.oai.completions.create(model=MODEL, prompt=system + q, max_tokens=2, temperature=0).usage
              for q in ("def fib(n):", "class Foo:")]
    after = scrape(served.url)

    def delta(name: str) -> float:
        return after.value(name, **LABELS) - before.value(name, **LABELS)

    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert delta("fusedserve_prefix_cache_queries_tokens_total") == prompt_tokens
    hits = delta("fusedserve_prefix_cache_hits_tokens_total")
    assert hits >= 16 and hits % 16 == 0 and hits < usages[1].prompt_tokens  # the second found the system prompt
    [group] = httpx.get(served.url + "/status").json()["groups"]
    assert group["prefix_caching"] is True and 0 < group["prefix_cache_hit_rate"] < 1


def test_every_series_has_the_common_labels_and_nothing_per_request(served: Served) -> None:
    served.oai.completions.create(model=MODEL, prompt="x = 1", max_tokens=2, temperature=0)
    s = scrape(served.url)
    allowed_extra = {"op", "group", "path", "position", "finished_reason", "le", "version", "model"}
    names = {x.name for f in s.families.values() for x in f.samples}
    assert all(name.startswith(("fusedserve_", "vllm:")) for name in names)
    for family in s.families.values():
        for x in family.samples:
            assert not any(v.startswith(("cmpl-", "chatcmpl-")) for v in x.labels.values()), x
            if x.name.startswith("vllm:"):  # vLLM's labels: the model, the engine group (engine series)
                assert x.labels["model_name"] == MODEL, x
                assert set(x.labels) <= {"model_name", "engine", "position", "finished_reason", "le"}, x
                continue
            assert {k: x.labels[k] for k in LABELS} == LABELS, x
            assert set(x.labels) <= set(LABELS) | allowed_extra, x
    assert s.families["fusedserve_time_to_first_token_seconds"].type == "histogram"
    buckets = [float(x.labels["le"]) for x in s.samples("fusedserve_time_to_first_token_seconds_bucket")]
    assert buckets[0] == 0.001 and 60.0 in buckets
    assert s.value("fusedserve_build_info", model=MODEL) == 1


# --- the exporter on hand-made snapshots (speculation, timing, several ranks) ----------------------


def test_spec_and_timing_series_from_snapshots() -> None:
    def snapshot(rank: str, drafts: int) -> MetricsSnapshot:
        return MetricsSnapshot(
            labels={**LABELS, "rank": rank, "tp_rank": rank},
            collective_calls={("all_reduce", "tp", "gloo"): 34 * drafts},
            collective_bytes={("all_reduce", "tp", "gloo"): 1024 * drafts},
            collective_planned={("all_reduce", "tp"): 34 * drafts},
            forwards=2 * drafts,
            collective_seconds={("all_reduce", "tp", "gloo"): HistogramData((1e-4, 1e-3), (3, 1, 1), 0.0021)},
            spec={"drafts": drafts, "draft_tokens": 3 * drafts, "accepted_tokens": 2 * drafts,
                  "per_position": [drafts, drafts, 0],
                  "accepted_per_step": HistogramData((0, 1, 2, 3), (0, 0, drafts, 0, 0), 2.0 * drafts)},
            serving={"running": 1, "waiting": 2, "kv_usage": 0.25, "finished": {"stop": 4}},
        )

    s = Scrape(MetricsRegistry(LABELS).exposition([snapshot("0", 10), snapshot("1", 10)]).decode())
    expected = {"spec_decode_drafts_total": 10, "spec_decode_draft_tokens_total": 30,
                "spec_decode_accepted_tokens_total": 20, "collective_calls_total": 340,
                "collective_bytes_total": 10240, "collective_planned_calls_total": 340,
                "forwards_total": 20, "num_requests_waiting": 2, "kv_cache_usage_ratio": 0.25}
    for name, value in expected.items():
        assert s.value("fusedserve_" + name, rank="1") == value, name
    assert s.value("fusedserve_collective_calls_total", rank="0") == s.value(
        "fusedserve_collective_planned_calls_total", rank="0")
    def by(name: str, key: str) -> dict[str, float]:
        return {x.labels[key]: x.value for x in s.samples("fusedserve_" + name) if x.labels["rank"] == "0"}

    assert by("spec_decode_accepted_tokens_per_position_total", "position") == {"0": 10, "1": 10, "2": 0}
    accepted, drafts = (s.value(f"fusedserve_spec_decode_{n}_total") for n in ("accepted_tokens", "drafts"))
    assert 1 + accepted / drafts == 3.0  # mean acceptance length, bonus token included
    per_step = by("spec_decode_accepted_tokens_per_step_bucket", "le")
    assert per_step == {"0.0": 0, "1.0": 0, "2.0": 10, "3.0": 10, "+Inf": 10}
    assert s.value("fusedserve_spec_decode_accepted_tokens_per_step_sum", rank="0") == 20
    assert by("collective_seconds_bucket", "le") == {"0.0001": 3, "0.001": 4, "+Inf": 5}
    assert s.value("fusedserve_request_success_total", finished_reason="stop", rank="0") == 4
    # No speculation, no timing: those families are absent rather than zero.
    bare = Scrape(MetricsRegistry(LABELS).exposition([MetricsSnapshot(labels=LABELS)]).decode())
    assert not any(n.startswith("fusedserve_spec_decode") for n in bare.families)
    assert "fusedserve_collective_seconds" not in bare.families
    assert set(SNAPSHOT_LABELS) == set(LABELS)


def test_spec_stats_read_from_the_engine() -> None:
    spec = {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 7, "accepted_per_position": [4, 2, 1],
            "accepted_per_step": {0: 0, 1: 2, 3: 1, 2: 1}}
    engine: Any = SimpleNamespace(stats=lambda: SimpleNamespace(spec=spec))
    snap = spec_snapshot(engine)
    assert (snap["drafts"], snap["draft_tokens"], snap["accepted_tokens"]) == (4, 12, 7)
    assert snap["per_position"] == [4, 2, 1]
    assert snap["accepted_per_step"] == HistogramData((0.0, 1.0, 2.0, 3.0), (0, 2, 1, 1, 0), 7.0)
    assert spec_snapshot(SimpleNamespace(stats=lambda: SimpleNamespace())) == {}  # type: ignore[arg-type]
