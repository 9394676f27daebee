"""The Service in front of a deployment's head pod: the OpenAI API and /metrics (pure)."""

from __future__ import annotations

from typing import Any

from .api import InferenceDeploymentSpec
from .naming import Owner


def head_selector(owner: Owner) -> dict[str, str]:
    """KubeRay's labels on the head pod of the deployment's RayCluster."""
    return {"ray.io/cluster": owner.ray_cluster, "ray.io/node-type": "head"}


def service_ports(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}]
    if spec.serving.metrics_port is not None and spec.serving.metrics_port != spec.serving.port:
        ports.append({"name": "metrics", "port": spec.serving.metrics_port, "targetPort": "metrics",
                      "protocol": "TCP"})
    return ports


def desired_service(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": owner.metadata(owner.service, "api"),
        "spec": {"type": "ClusterIP", "selector": head_selector(owner), "ports": service_ports(spec)},
    }


def endpoint(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    """The OpenAI base URL inside the cluster."""
    return f"http://{owner.service}.{owner.namespace}.svc:{spec.serving.port}/v1"

