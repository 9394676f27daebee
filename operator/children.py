"""Everything an InferenceDeployment owns, from its body (pure).

``parse_spec`` is the operator's view of validity: the CRD schema and CEL rules catch most
mistakes at the API server; this catches the rest (and everything, where no validating API
server exists), with one message naming each offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fusedserve.worker.spec import Manifest, RuntimeConfig, SpecError, format_validation_error

from .api import InferenceDeploymentSpec
from .engine_config import config_hash, desired_config_map, runtime_manifest
from .naming import Owner
from .pod_monitor import desired_pod_monitor
from .ray_cluster import desired_ray_cluster, worker_sizing
from .service import desired_service

# Deleted with the deployment, in this order (what serves goes first).
CHILD_KINDS = ("PodMonitor", "Service", "RayCluster", "ConfigMap")


def parse_spec(body: dict[str, Any]) -> InferenceDeploymentSpec:
    raw = body.get("spec")
    if not isinstance(raw, dict):
        raise SpecError("spec: must be a mapping")
    try:
        spec = InferenceDeploymentSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, "spec")) from e
    owner = Owner.of(body)
    try:  # what the runtime refuses although the schema allows it
        RuntimeConfig.from_manifest(Manifest.model_validate(runtime_manifest(owner, spec)))
    except ValidationError as e:
        raise SpecError(format_validation_error(e, "").removeprefix(".")) from e
    worker_sizing(spec)
    return spec


@dataclass(frozen=True)
class Children:
    config_map: dict[str, Any]
    ray_cluster: dict[str, Any]
    service: dict[str, Any]
    pod_monitor: dict[str, Any] | None

    def all(self) -> list[dict[str, Any]]:
        objs = [self.config_map, self.ray_cluster, self.service]
        return objs + ([self.pod_monitor] if self.pod_monitor is not None else [])


def desired_children(owner: Owner, spec: InferenceDeploymentSpec, pod_monitor_crd: bool) -> Children:
    """``pod_monitor_crd``: whether the Prometheus Operator's PodMonitor kind exists in the cluster."""
    config_map = desired_config_map(owner, spec)
    digest = config_hash(config_map["data"]["deployment.yaml"])
    monitor = desired_pod_monitor(owner, spec) if spec.monitoring.pod_monitor and pod_monitor_crd else None
    return Children(config_map, desired_ray_cluster(owner, spec, digest), desired_service(owner, spec), monitor)


def child_names(owner: Owner) -> dict[str, str]:
    return {"PodMonitor": owner.pod_monitor, "Service": owner.service, "RayCluster": owner.ray_cluster,
            "ConfigMap": owner.config_map}
