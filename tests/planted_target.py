"""A scrape target that is a real worker with one extra collective planted: what the extra-collectives alert is for.

The product has no hook to run a collective its plan lacks, and it gets none for the tests. Instead Prometheus
also scrapes this small proxy: on every scrape it fetches a running worker's ``/metrics``, keeps the
communication families (``fusedserve_collective_*``, ``fusedserve_forwards_total``), renames the deployment
(so its series never mix with the real one's) and adds, from that scrape's own forward counts:

- rank 0: one more ``all_reduce`` per forward than it ran (and planned) on its first all-reduce series:
  executed above plan for an op the plan has (the "reduce twice" bug);
- rank 1: one ``reduce_scatter`` on group ``tp`` per forward, an op its plan never has (the ``unless`` branch).

Everything else is the real worker's live counters, so the alert sees the rates it would see on a
deployment whose ranks ran those collectives, and the real deployment next to it must stay silent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

KEPT = ("fusedserve_collective_", "fusedserve_forwards")
CALLS = "fusedserve_collective_calls_total"
FORWARDS = "fusedserve_forwards_total"
EXTRA_ALL_REDUCE_RANK = "0"
EXTRA_REDUCE_SCATTER_RANK = "1"


def planted(text: str, deployment: str) -> bytes:
    """The exposition ``text`` of a worker with the extra collectives above, as deployment ``deployment``."""
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith(KEPT)]
    for f in families:
        f.samples = [s._replace(labels={**s.labels, "deployment": deployment}) for s in f.samples]
    forwards = {s.labels["rank"]: s.value for f in families for s in f.samples if s.name == FORWARDS}
    [calls] = [f for f in families if f.samples and f.samples[0].name == CALLS]
    bumped = False
    for i, s in enumerate(calls.samples):
        if not bumped and s.labels["rank"] == EXTRA_ALL_REDUCE_RANK and s.labels["op"] == "all_reduce":
            calls.samples[i] = s._replace(value=s.value + forwards[EXTRA_ALL_REDUCE_RANK])
            bumped = True
    if not bumped:
        raise ValueError(f"rank {EXTRA_ALL_REDUCE_RANK} of the upstream worker runs no all_reduce")
    template = next(s for s in calls.samples if s.labels["rank"] == EXTRA_REDUCE_SCATTER_RANK)
    calls.samples.append(template._replace(
        labels={**template.labels, "op": "reduce_scatter", "group": "tp", "path": "gloo"},
        value=forwards[EXTRA_REDUCE_SCATTER_RANK]))

    class Families(Collector):
        def collect(self) -> Iterable[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


class PlantedTarget:
    """Serves ``planted(GET upstream/metrics)`` on 127.0.0.1:``port``/metrics until ``stop()``."""

    def __init__(self, upstream: str, deployment: str, port: int = 0) -> None:
        self.upstream, self.deployment = upstream, deployment
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                try:
                    body = planted(httpx.get(f"{target.upstream}/metrics", timeout=10).text, target.deployment)
                except (httpx.HTTPError, ValueError) as e:
                    self.send_error(502, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                try:
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Prometheus gave up on this scrape (its timeout): it records it as up == 0 itself

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = int(self._server.server_address[1])
        self.address = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="planted-target", daemon=True)

    def start(self) -> PlantedTarget:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
