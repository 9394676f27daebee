"""vLLM-named twins of the serving metrics (``vllm:`` prefix, ``model_name`` label), so that vLLM's Grafana
dashboards, KEDA/HPA recipes written for vLLM and the Gateway API Inference Extension's endpoint picker
read a fusedserve server unchanged. Names, labels and buckets as vLLM's v1 ``PrometheusStatLogger``.

Engine series come from the engine snapshots, summed per engine group (``engine`` = the group index; a
group's followers carry no serving counters, and a group with several leaders counts once), so they are
one series per engine group, never per rank::

    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1, the group's
    mean), vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
    vllm:request_success_total{finished_reason}, vllm:spec_decode_num_drafts_total,
    vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens, from
        the snapshot's serving keys "prefix_cache_queries" / "prefix_cache_hits")

Request histograms are observed where the API sees the request (``MetricsRegistry.track``), labels
``model_name`` only: vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:time_per_output_token_seconds, vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds, vllm:request_prompt_tokens,
vllm:request_generation_tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.sequence import FinishReason
from .engine_client import MetricsSnapshot

PREFIX = "vllm:"
ENGINE_LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# Engine counters (snapshot serving key -> vLLM name).
COUNTERS = (("prompt_tokens", "prompt_tokens_total", "Prompt tokens prefilled."),
            ("generation_tokens", "generation_tokens_total", "Tokens generated."),
            ("preemptions", "num_preemptions_total", "Requests preempted."),
            ("prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."))
SPEC_COUNTERS = (("drafts", "spec_decode_num_drafts_total", "Speculative verify steps."),
                 ("draft_tokens", "spec_decode_num_draft_tokens_total", "Draft tokens proposed."),
                 ("accepted_tokens", "spec_decode_num_accepted_tokens_total", "Draft tokens accepted."))


def length_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def _by_group(snapshots: list[MetricsSnapshot], part: str) -> dict[str, list[MetricsSnapshot]]:
    groups: dict[str, list[MetricsSnapshot]] = {}
    for s in snapshots:
        if getattr(s, part):
            groups.setdefault(s.labels.get("engine_group", ""), []).append(s)
    return groups


class VllmSnapshotCollector:
    """The engine-side twins of the current scrape's snapshots (set by ``MetricsRegistry.exposition``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: list[MetricsSnapshot] = []

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        serving = _by_group(self.snapshots, "serving")
        for key, name, doc in (("running", "num_requests_running", "Requests running."),
                               ("waiting", "num_requests_waiting", "Requests waiting.")):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=ENGINE_LABELS)
            for engine, snaps in sorted(serving.items()):
                gauge.add_metric([self.model_name, engine], float(sum(s.serving.get(key, 0) for s in snaps)))
            yield gauge
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV-cache usage (1 = full).", labels=ENGINE_LABELS)
        for engine, snaps in sorted(serving.items()):
            usage.add_metric([self.model_name, engine], sum(float(s.serving.get("kv_usage", 0.0)) for s in snaps)
                             / len(snaps))
        yield usage
        for key, name, doc in COUNTERS:
            present = {e: snaps for e, snaps in serving.items() if any(key in s.serving for s in snaps)}
            if not present:
                continue
            counter = CounterMetricFamily(PREFIX + name, doc, labels=ENGINE_LABELS)
            for engine, snaps in sorted(present.items()):
                counter.add_metric([self.model_name, engine], float(sum(s.serving.get(key, 0) for s in snaps)))
            yield counter
        success = CounterMetricFamily(PREFIX + "request_success_total", "Requests finished, by reason.",
                                      labels=[*ENGINE_LABELS, "finished_reason"])
        for engine, snaps in sorted(serving.items()):
            for reason in FinishReason:
                n = sum(s.serving.get("finished", {}).get(reason.value, 0) for s in snaps)
                success.add_metric([self.model_name, engine, reason.value], float(n))
        yield success
        yield from self._spec(_by_group(self.snapshots, "spec"))

    def _spec(self, groups: dict[str, list[MetricsSnapshot]]) -> Iterable[Metric]:
        if not groups:
            return
        for key, name, doc in SPEC_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=ENGINE_LABELS)
            for engine, snaps in sorted(groups.items()):
                counter.add_metric([self.model_name, engine], float(sum(int(s.spec.get(key, 0)) for s in snaps)))
            yield counter
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                                      "Draft tokens accepted at each draft position (0 = first).",
                                      labels=[*ENGINE_LABELS, "position"])
        for engine, snaps in sorted(groups.items()):
            depth = max(len(s.spec.get("per_position", [])) for s in snaps)
            for pos in range(depth):
                n = sum(s.spec.get("per_position", [])[pos] for s in snaps if pos < len(s.spec.get("per_position", [])))
                per_pos.add_metric([self.model_name, engine, str(pos)], float(n))
        yield per_pos


class VllmRequestHistograms:
    """The request-level twins, observed by ``MetricsRegistry.track``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=registry).labels(model_name=model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between outputs of a request.", ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (generated tokens - 1).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to its last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)
        lengths = length_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens generated per request.", lengths)
