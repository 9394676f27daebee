"""The NetworkPolicy of a deployment's pods (pure): Ray only among themselves, the API only to chosen clients.

Ray's ports (GCS, raylets, object transfer, the worker ports) accept any connection that reaches them;
with token authentication on (ray_auth.py) a caller still needs the token, and this policy keeps every
other pod from reaching them at all. Ingress to the deployment's pods (head and workers, of every
RayCluster of the deployment):

- from the deployment's own pods: every port;
- the API port: the operator (it reads ``/status``) and ``networkPolicy.apiClients`` (default: every pod
  of the namespace);
- the metrics port (the API port when ``serving.metricsPort`` is unset): ``networkPolicy.metricsClients``
  (default: Prometheus pods, ``app.kubernetes.io/name=prometheus``, in any namespace).

Egress is left open (downloads from the Hub or S3, DNS). The kubelet's probes are not subject to it.
"""

from __future__ import annotations

from typing import Any

from .api import InferenceDeploymentSpec
from .naming import Owner
from .pod_types import NetworkPeer

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# Labels of the operator's pods (the chart's selector labels carry them).
OPERATOR_POD_LABELS = {"app.kubernetes.io/part-of": "fusedserve", "app.kubernetes.io/component": "operator"}
PROMETHEUS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def _peers(peers: list[NetworkPeer]) -> list[dict[str, Any]]:
    return [p.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) for p in peers]


def operator_peer(operator_namespace: str | None) -> dict[str, Any]:
    """The operator's pods, in its namespace when known (else in any namespace)."""
    namespaces = {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}} if operator_namespace else {}
    return {"namespaceSelector": namespaces, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}


def desired_network_policy(owner: Owner, spec: InferenceDeploymentSpec,
                           operator_namespace: str | None) -> dict[str, Any]:
    np = spec.network_policy
    own = {"podSelector": {"matchLabels": owner.pod_labels()}}
    api_clients = [{"podSelector": {}}] if np.api_clients is None else _peers(np.api_clients)
    metrics_clients = [PROMETHEUS] if np.metrics_clients is None else _peers(np.metrics_clients)
    api_port = {"protocol": "TCP", "port": spec.serving.port}
    rules: list[dict[str, Any]] = [
        {"from": [own]},
        {"from": [operator_peer(operator_namespace), *api_clients], "ports": [api_port]},
    ]
    metrics_port = spec.serving.metrics_port
    if metrics_clients:
        port = metrics_port if metrics_port is not None else spec.serving.port
        rules.append({"from": metrics_clients, "ports": [{"protocol": "TCP", "port": port}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": owner.metadata(owner.network_policy, "network-policy"),
        "spec": {"podSelector": {"matchLabels": owner.pod_labels()}, "policyTypes": ["Ingress"], "ingress": rules},
    }
