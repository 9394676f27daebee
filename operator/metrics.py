"""Every Prometheus metric of the operator process (prefix ``fusedserve_operator_``, base units).

    fusedserve_operator_reconciles_total{result}        result: success, temporary_error, permanent_error
    fusedserve_operator_reconcile_duration_seconds      histogram of one reconcile (children applied)
    fusedserve_operator_time_to_ready_seconds           histogram: creation -> first Ready=True
    fusedserve_operator_status_fetch_errors_total       the group controller's /status could not be read
    fusedserve_operator_deployments{condition,status}   InferenceDeployments by condition (gauge)

Served by ``OperatorMetrics.serve(port)`` on ``/metrics`` (one registry per process; tests make their own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RESULTS = ("success", "temporary_error", "permanent_error")
CONDITIONS = ("Ready", "Progressing", "Scheduled", "Degraded")
STATUSES = ("True", "False", "Unknown")
# 10 ms .. 10 min (reconciles are fast; time to Ready includes pulling images and loading weights)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("fusedserve_operator_reconciles", "Reconciles of InferenceDeployments by result",
                                  ["result"], registry=r)
        self.reconcile_duration = Histogram("fusedserve_operator_reconcile_duration_seconds",
                                            "Time to apply one InferenceDeployment's children",
                                            buckets=DURATION_BUCKETS, registry=r)
        self.time_to_ready = Histogram("fusedserve_operator_time_to_ready_seconds",
                                       "From creation to the first Ready=True condition",
                                       buckets=DURATION_BUCKETS, registry=r)
        self.status_fetch_errors = Counter("fusedserve_operator_status_fetch_errors",
                                           "Reads of a group controller's /status that failed", registry=r)
        self.deployments = Gauge("fusedserve_operator_deployments", "InferenceDeployments by condition and status",
                                 ["condition", "status"], registry=r)
        for result in RESULTS:
            self.reconciles.labels(result=result)
        for c in CONDITIONS:
            for s in STATUSES:
                self.deployments.labels(condition=c, status=s).set(0)

    def set_deployments(self, conditions_per_object: Iterable[Mapping[str, str]]) -> None:
        """One {condition type: status} mapping per InferenceDeployment the operator knows."""
        counts = {(c, s): 0 for c in CONDITIONS for s in STATUSES}
        for conds in conditions_per_object:
            for c, s in conds.items():
                if (c, s) in counts:
                    counts[(c, s)] += 1
        for (c, s), n in counts.items():
            self.deployments.labels(condition=c, status=s).set(n)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
