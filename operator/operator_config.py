"""The operator process's settings, decided once at start (flags, else environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_PREFIX = "FUSEDSERVE_OPERATOR_"
DEFAULT_WORKER_IMAGE = "ghcr.io/fusedserve/worker:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    # Where a RayCluster's group controller serves /status; "{name}", "{namespace}", "{service}",
    # "{cluster}", "{port}" are filled in. Default: the cluster's head Service (KubeRay's "<cluster>-head-svc").
    status_url_template: str = "http://{cluster}-head-svc.{namespace}.svc:{port}/status"
    status_interval_s: float = 10.0  # how often /status and the RayCluster are mirrored into the CR
    metrics_port: int | None = None  # Prometheus /metrics of the operator (None: not served)
    retry_delay_s: float = 10.0  # a temporary error (API conflict, KubeRay missing) retries after this
    listen_address: str = "0.0.0.0"  # of the metrics endpoint
    worker_image: str = DEFAULT_WORKER_IMAGE  # an InferenceDeployment's spec.image when it sets none
    namespace: str | None = None  # the operator's own namespace (POD_NAMESPACE): its NetworkPolicy peer
    peering_lifetime_s: int = 15  # a silent peer is presumed dead after this (another replica takes over)

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
            worker_image=e.get(ENV_PREFIX + "WORKER_IMAGE") or d.worker_image,
            namespace=e.get(ENV_PREFIX + "NAMESPACE") or e.get("POD_NAMESPACE") or None,
            peering_lifetime_s=int(e.get(ENV_PREFIX + "PEERING_LIFETIME", d.peering_lifetime_s)),
        )

    def status_url(self, name: str, namespace: str, service: str, cluster: str, port: int) -> str:
        return self.status_url_template.format(name=name, namespace=namespace, service=service, cluster=cluster,
                                               port=port)
