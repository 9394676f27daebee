"""The Service in front of a deployment's head pod: the OpenAI API and /metrics (pure).

It selects the head of one RayCluster, the one serving (rollout.py): switching a rollout to a new
cluster is changing this selector.
"""

from __future__ import annotations

from typing import Any

from .api import InferenceDeploymentSpec
from .naming import LABEL_CLUSTER, LABEL_NODE_TYPE, Owner


def head_selector(ray_cluster: str) -> dict[str, str]:
    """KubeRay's labels on the head pod of a RayCluster."""
    return {LABEL_CLUSTER: ray_cluster, LABEL_NODE_TYPE: "head"}


def service_ports(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}]
    if spec.serving.metrics_port is not None and spec.serving.metrics_port != spec.serving.port:
        ports.append({"name": "metrics", "port": spec.serving.metrics_port, "targetPort": "metrics",
                      "protocol": "TCP"})
    return ports


def desired_service(owner: Owner, spec: InferenceDeploymentSpec, ray_cluster: str) -> dict[str, Any]:
    settings = spec.service
    meta = owner.metadata(owner.service, "api", dict(settings.annotations) or None)
    meta["labels"] = {**settings.labels, **meta["labels"]}
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta,
        "spec": {"type": settings.type, "selector": head_selector(ray_cluster), "ports": service_ports(spec)},
    }


def selected_cluster(service: dict[str, Any] | None) -> str | None:
    """The RayCluster a live Service sends requests to (None: no Service yet)."""
    if service is None:
        return None
    return ((service.get("spec") or {}).get("selector") or {}).get(LABEL_CLUSTER)


def endpoint(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    """The OpenAI base URL inside the cluster."""
    return f"http://{owner.service}.{owner.namespace}.svc:{spec.serving.port}/v1"

