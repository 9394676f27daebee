"""Every Prometheus metric of the serving process (prefix ``fusedserve_``, base units).

Two sources:

- Engine counters and gauges come from ``EngineClient.metrics()`` snapshots, exported by a
  custom collector at scrape time: the exported value *is* the engine's counter (never
  re-accumulated here), one series per rank/group with the labels deployment, namespace,
  engine_group, rank, tp_rank, dp_rank, ep_rank ("group" is the collective's parallel group).
- Request latencies (time to first token, inter-token latency, end-to-end) are measured where
  the API sees the request (``MetricsRegistry.track``) and carry the server's labels.

Names (counters end in ``_total``; labels beyond the common ones in braces)::

    fusedserve_spec_decode_drafts_total, _draft_tokens_total, _accepted_tokens_total,
    fusedserve_spec_decode_accepted_tokens_per_position_total{position},
    fusedserve_spec_decode_accepted_tokens_per_step (histogram)
    fusedserve_collective_calls_total{op,group,path}, fusedserve_collective_bytes_total{op,group,path},
    fusedserve_collective_seconds{op,group,path} (histogram, sampled: every gloo call; 1 in 64 NCCL/FlashInfer
        calls per series, CUDA events, outside CUDA graphs),
    fusedserve_collective_planned_calls_total{op,group} (each forward's own plan variant, counted as it
        starts), fusedserve_forwards_total
    fusedserve_num_requests_running, fusedserve_num_requests_waiting, fusedserve_kv_cache_usage_ratio,
    fusedserve_num_preemptions_total, fusedserve_prompt_tokens_total, fusedserve_generation_tokens_total,
    fusedserve_prefix_cache_queries_tokens_total, fusedserve_prefix_cache_hits_tokens_total,
    fusedserve_request_success_total{finished_reason}
    fusedserve_time_to_first_token_seconds, fusedserve_inter_token_latency_seconds,
    fusedserve_e2e_request_latency_seconds, fusedserve_request_queue_time_seconds,
    fusedserve_request_prefill_time_seconds, fusedserve_request_decode_time_seconds,
    fusedserve_request_prompt_tokens, fusedserve_request_generation_tokens (histograms),
    fusedserve_build_info{version,model}
    fusedserve_api_errors_total{code} (every error the API answered, by its OpenAI-style code:
        context_length_exceeded, too_many_sequences, request_too_large, request_timeout,
        invalid_api_key, shutting_down, no_ready_engine, engine_dead, internal_error, ...)

Beside them, the vLLM-named twins (``vllm:*``, label ``model_name``): ``vllm_metrics.py``.

PromQL: mean acceptance length = ``1 + rate(..accepted_tokens_total) / rate(..drafts_total)``; prefix-cache
hit rate = ``rate(..prefix_cache_hits_tokens_total) / rate(..prefix_cache_queries_tokens_total)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..engine.outputs import RequestOutput
from ..engine.sequence import FinishReason
from .engine_client import SNAPSHOT_LABELS, HistogramData, MetricsSnapshot
from .vllm_metrics import VllmRequestHistograms, VllmSnapshotCollector, length_buckets

PREFIX = "fusedserve_"
LABELS = SNAPSHOT_LABELS
DEFAULT_MAX_MODEL_LEN = 131072  # the request length histograms' top bucket when the server does not say
# 1 ms .. 60 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)


def _values(labels: Mapping[str, str]) -> list[str]:
    return [str(labels.get(k, "")) for k in LABELS]


def _histogram_buckets(h: HistogramData) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, ending in +Inf."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(h.bounds, h.counts):
        total += n
        out.append((_le(bound), float(total)))
    total += sum(h.counts[len(h.bounds):])
    out.append(("+Inf", float(total)))
    return out


def _le(bound: float) -> str:
    return floatToGoString(bound)  # as prometheus_client's own histograms: "1.0", "0.001"


class SnapshotCollector(Collector):
    """Exports the engine snapshots of the current scrape (set by ``MetricsRegistry.exposition``)."""

    def __init__(self) -> None:
        self.snapshots: list[MetricsSnapshot] = []

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        snapshots = self.snapshots
        yield from self._spec(snapshots)
        yield from self._communication(snapshots)
        yield from self._serving(snapshots)

    @staticmethod
    def _spec(snapshots: list[MetricsSnapshot]) -> Iterable[Metric]:
        with_spec = [s for s in snapshots if s.spec]
        if not with_spec:
            return
        for key, name, doc in (
            ("drafts", "spec_decode_drafts_total", "Speculative verify steps (one per sequence and step)."),
            ("draft_tokens", "spec_decode_draft_tokens_total", "Draft tokens proposed."),
            ("accepted_tokens", "spec_decode_accepted_tokens_total",
             "Draft tokens accepted (bonus excluded)."),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            for s in with_spec:
                family.add_metric(_values(s.labels), float(s.spec.get(key, 0)))
            yield family
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_accepted_tokens_per_position_total",
                                      "Draft tokens accepted at each draft position (0 = first).",
                                      labels=[*LABELS, "position"])
        per_step = HistogramMetricFamily(PREFIX + "spec_decode_accepted_tokens_per_step",
                                         "Draft tokens accepted per sequence and verify step.", labels=LABELS)
        for s in with_spec:
            for position, n in enumerate(s.spec.get("per_position", [])):
                per_pos.add_metric([*_values(s.labels), str(position)], float(n))
            hist = s.spec.get("accepted_per_step")
            if isinstance(hist, HistogramData):
                per_step.add_metric(_values(s.labels), _histogram_buckets(hist), hist.sum)
        yield per_pos
        yield per_step

    @staticmethod
    def _communication(snapshots: list[MetricsSnapshot]) -> Iterable[Metric]:
        keys = [*LABELS, "op", "group", "path"]
        calls = CounterMetricFamily(PREFIX + "collective_calls_total",
                                    "Collectives executed (size-1 groups run none).", labels=keys)
        nbytes = CounterMetricFamily(PREFIX + "collective_bytes_total",
                                     "Bytes handed to executed collectives.", labels=keys)
        planned = CounterMetricFamily(PREFIX + "collective_planned_calls_total",
                                      "Collectives planned: each forward's own plan variant, counted as it starts.",
                                      labels=[*LABELS, "op", "group"])
        forwards = CounterMetricFamily(PREFIX + "forwards_total", "Model forwards run.", labels=LABELS)
        seconds = HistogramMetricFamily(PREFIX + "collective_seconds",
                                        "Sampled durations of collectives.", labels=keys)
        for s in snapshots:
            base = _values(s.labels)
            for (op, group, path), n in sorted(s.collective_calls.items()):
                calls.add_metric([*base, op, group, path], float(n))
            for (op, group, path), n in sorted(s.collective_bytes.items()):
                nbytes.add_metric([*base, op, group, path], float(n))
            for (op, group), n in sorted(s.collective_planned.items()):
                planned.add_metric([*base, op, group], float(n))
            forwards.add_metric(base, float(s.forwards))
            for (op, group, path), h in sorted(s.collective_seconds.items()):
                seconds.add_metric([*base, op, group, path], _histogram_buckets(h), h.sum)
        yield from (calls, nbytes, planned, forwards)
        if any(s.collective_seconds for s in snapshots):
            yield seconds

    @staticmethod
    def _serving(snapshots: list[MetricsSnapshot]) -> Iterable[Metric]:
        gauges = [
            ("running", "num_requests_running", "Requests running (scheduled) now."),
            ("waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
            ("kv_usage", "kv_cache_usage_ratio", "Share of KV-cache blocks in use (0..1)."),
        ]
        counters = [
            ("preemptions", "num_preemptions_total", "Sequences preempted (recomputed later)."),
            ("prompt_tokens", "prompt_tokens_total", "Prompt tokens prefilled."),
            ("generation_tokens", "generation_tokens_total", "Tokens generated."),
            ("prefix_cache_queries", "prefix_cache_queries_tokens_total",
             "Prompt tokens looked up in the prefix cache when a sequence was admitted (0 with caching off)."),
            ("prefix_cache_hits", "prefix_cache_hits_tokens_total",
             "Of the looked-up tokens, those found in cached KV blocks (their prefill skipped)."),
        ]
        with_serving = [s for s in snapshots if s.serving]
        for key, name, doc in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            for s in with_serving:
                family.add_metric(_values(s.labels), float(s.serving.get(key, 0)))
            yield family
        for key, name, doc in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            for s in with_serving:
                counter.add_metric(_values(s.labels), float(s.serving.get(key, 0)))
            yield counter
        success = CounterMetricFamily(PREFIX + "request_success_total", "Requests finished, by reason.",
                                      labels=[*LABELS, "finished_reason"])
        for s in with_serving:
            finished: dict[str, int] = s.serving.get("finished", {})
            for reason in FinishReason:  # every reason, so rate() sees the first one
                success.add_metric([*_values(s.labels), reason.value], float(finished.get(reason.value, 0)))
        yield success


class MetricsRegistry:
    """The serving process's registry: engine snapshots plus request latencies.

    ``labels`` are the server's values of the common labels (for a server in front of one
    engine, that engine's labels; for a controller in front of many groups, deployment and
    namespace with the rest empty).
    """

    def __init__(self, labels: Mapping[str, str] | None = None, model_name: str = "",
                 version: str | None = None, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        disable_created_metrics()  # no *_created series (process-wide, as vLLM does)
        self.registry = CollectorRegistry(auto_describe=False)
        self.labels = {k: str((labels or {}).get(k, "")) for k in LABELS}
        self._collector = SnapshotCollector()
        self._vllm = VllmSnapshotCollector(model_name)
        self.registry.register(self._collector)
        self.registry.register(self._vllm)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self.vllm = VllmRequestHistograms(self.registry, model_name, max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Any:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets,
                             registry=self.registry).labels(**self.labels)

        self.queue = histogram("request_queue_time_seconds", "Time from request to first scheduled.")
        self.prefill = histogram("request_prefill_time_seconds", "Time from first scheduled to the first token.")
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last.")
        lengths = length_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per finished request.", lengths)
        self.generation_len = histogram("request_generation_tokens", "Tokens generated per finished request.",
                                        lengths)

        self.ttft = histogram("time_to_first_token_seconds", "Time from request to its first token.")
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two outputs of a request (one per engine step).")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to its last token.")
        self._errors = Counter(PREFIX + "api_errors", "Errors the API answered, by error code.", [*LABELS, "code"],
                               registry=self.registry)
        info = Gauge(PREFIX + "build_info", "fusedserve version and served model.",
                     [*LABELS, "version", "model"], registry=self.registry)
        info.labels(**self.labels, version=version or package_version(), model=model_name).set(1)

    def count_error(self, code: str) -> None:
        self._errors.labels(**self.labels, code=code).inc()

    def exposition(self, snapshots: list[MetricsSnapshot]) -> bytes:
        """The Prometheus text exposition with these engine snapshots."""
        with self._lock:
            self._collector.snapshots = self._vllm.snapshots = snapshots
            try:
                return generate_latest(self.registry)
            finally:
                self._collector.snapshots = self._vllm.snapshots = []

    async def track(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, observing its latencies (aborted requests: none). A request
        whose tokens all come in its last output (``final_only``, or done in one step) had its first token
        ``times.decode_s`` before that output arrived, and its inter-token latencies are the gaps between its
        steps (``out.gaps``): the engine's clock, as vLLM observes every request's from its engine's outputs."""
        start = last = time.perf_counter()
        first_at: float | None = None
        try:
            async for out in outputs:
                now = time.perf_counter()
                if out.new_token_ids:
                    if first_at is None:
                        first_at = now
                        if out.finished and out.times is not None:
                            first_at = max(start, now - out.times.decode_s)
                        for gap in out.gaps:
                            self.itl.observe(gap)
                            self.vllm.itl.observe(gap)
                        self.ttft.observe(first_at - start)
                        self.vllm.ttft.observe(first_at - start)
                    else:
                        self.itl.observe(now - last)
                        self.vllm.itl.observe(now - last)
                    last = now
                if out.finished and out.finish_reason is not FinishReason.ABORT:
                    self._finished(out, now - start, None if first_at is None else now - first_at)
                yield out
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()


    def _finished(self, out: RequestOutput, e2e: float, after_first: float | None) -> None:
        v = self.vllm
        self.e2e.observe(e2e)
        v.e2e.observe(e2e)
        if after_first is not None and out.num_output_tokens > 1:
            v.tpot.observe(after_first / (out.num_output_tokens - 1))
        pairs: list[tuple[Any, Any, float]] = [
            (self.prompt_len, v.prompt_tokens, float(out.num_prompt_tokens)),
            (self.generation_len, v.generation_tokens, float(out.num_output_tokens))]
        if out.times is not None:
            pairs += [(self.queue, v.queue, out.times.queue_s), (self.prefill, v.prefill, out.times.prefill_s),
                      (self.decode, v.decode, out.times.decode_s)]
        for ours, theirs, value in pairs:
            ours.observe(value)
            theirs.observe(value)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusedserve")
    except PackageNotFoundError:
        return "unknown"
