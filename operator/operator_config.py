"""The operator process's settings, decided once at start (flags, else environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_PREFIX = "FUSEDSERVE_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    # Where a deployment's group controller serves /status; "{name}", "{namespace}", "{service}",
    # "{port}" are filled in. Default: the deployment's Service inside the cluster.
    status_url_template: str = "http://{service}.{namespace}.svc:{port}/status"
    status_interval_s: float = 10.0  # how often /status and the RayCluster are mirrored into the CR
    metrics_port: int | None = None  # Prometheus /metrics of the operator (None: not served)
    retry_delay_s: float = 10.0  # a temporary error (API conflict, KubeRay missing) retries after this
    listen_address: str = "0.0.0.0"  # of the metrics endpoint

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        e = dict(os.environ if env is None else env)
        d = cls()
        port = e.get(ENV_PREFIX + "METRICS_PORT")
        return cls(
            status_url_template=e.get(ENV_PREFIX + "STATUS_URL_TEMPLATE", d.status_url_template),
            status_interval_s=float(e.get(ENV_PREFIX + "STATUS_INTERVAL", d.status_interval_s)),
            metrics_port=int(port) if port else None,
            retry_delay_s=float(e.get(ENV_PREFIX + "RETRY_DELAY", d.retry_delay_s)),
            listen_address=e.get(ENV_PREFIX + "LISTEN_ADDRESS", d.listen_address),
        )

    def status_url(self, name: str, namespace: str, service: str, port: int) -> str:
        return self.status_url_template.format(name=name, namespace=namespace, service=service, port=port)
