"""The PodMonitor that makes Prometheus scrape a deployment's head pod (pure).

The group controller on the head exports every rank's metrics; ``honorLabels`` keeps their own
``namespace``/``deployment`` labels.
"""

from __future__ import annotations

from typing import Any

from .api import InferenceDeploymentSpec
from .naming import LABEL_DEPLOYMENT, Owner

CRD_NAME = "podmonitors.monitoring.coreos.com"
SCRAPE_INTERVAL = "15s"


def desired_pod_monitor(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    port = "metrics" if spec.serving.metrics_port not in (None, spec.serving.port) else "http"
    endpoint: dict[str, Any] = {"port": port, "path": "/metrics", "interval": SCRAPE_INTERVAL, "honorLabels": True}
    key = spec.serving.api_key_secret
    if key is not None:  # the API key, in case /metrics asks for it too
        endpoint["authorization"] = {"type": "Bearer", "credentials": {"name": key.name, "key": key.key}}
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": owner.metadata(owner.pod_monitor, "monitoring"),
        "spec": {
            "selector": {"matchLabels": {LABEL_DEPLOYMENT: owner.base, "ray.io/node-type": "head"}},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "podMetricsEndpoints": [endpoint],
        },
    }
