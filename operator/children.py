"""Everything an InferenceDeployment owns, from its body (pure).

``parse_spec`` is the operator's view of validity: the CRD schema and CEL rules catch most
mistakes at the API server; this catches the rest (and everything, where no validating API
server exists), with one message naming each offending field.

Children: the RayCluster named by its pod revision and its engine ConfigMap, the Service (selecting
the serving cluster's head, rollout.py), the NetworkPolicy, the PodDisruptionBudget, the PodMonitor,
and the Ray token Secret (created once, never rewritten: ray_auth.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fusedserve.worker.spec import Manifest, RuntimeConfig, SpecError, format_validation_error

from .api import InferenceDeploymentSpec
from .disruption_budget import desired_disruption_budget
from .engine_config import config_hash, desired_config_map, runtime_manifest
from .naming import Owner
from .network_policy import desired_network_policy
from .operator_config import DEFAULT_WORKER_IMAGE
from .pod_monitor import desired_pod_monitor
from .ray_cluster import desired_ray_cluster, pod_revision
from .service import desired_service

# Every kind the operator makes, in the order deletion takes them (what serves goes first).
CHILD_KINDS = ("PodMonitor", "Service", "PodDisruptionBudget", "NetworkPolicy", "RayCluster", "ConfigMap",
               "Secret")


@dataclass(frozen=True)
class Context:
    """What the planners need besides the spec: facts about the cluster and the operator's settings."""

    pod_monitor_crd: bool = True  # the Prometheus Operator's PodMonitor kind exists
    worker_image: str = DEFAULT_WORKER_IMAGE  # spec.image's default (the chart's workerImage)
    operator_namespace: str | None = None  # where the operator runs (the NetworkPolicy lets it in)

    def image(self, spec: InferenceDeploymentSpec) -> str:
        return spec.image or self.worker_image


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
    pod_revision(owner, spec, DEFAULT_WORKER_IMAGE)  # sizing, model sources, pod settings
    return spec


def desired_cluster(owner: Owner, spec: InferenceDeploymentSpec, ctx: Context) -> str:
    """The name of the RayCluster the spec wants (a new name exactly when it needs new pods)."""
    return owner.ray_cluster(pod_revision(owner, spec, ctx.image(spec)))


@dataclass(frozen=True)
class Children:
    config_map: dict[str, Any]
    ray_cluster: dict[str, Any]
    service: dict[str, Any]
    network_policy: dict[str, Any] | None
    disruption_budget: dict[str, Any] | None
    pod_monitor: dict[str, Any] | None

    def all(self) -> list[dict[str, Any]]:
        objs = [self.config_map, self.ray_cluster, self.service, self.network_policy, self.disruption_budget,
                self.pod_monitor]
        return [o for o in objs if o is not None]

    def absent(self) -> list[str]:
        """Kinds of one-per-deployment children the spec does not want (deleted if they exist)."""
        return [kind for kind, obj in (("NetworkPolicy", self.network_policy),
                                       ("PodDisruptionBudget", self.disruption_budget),
                                       ("PodMonitor", self.pod_monitor)) if obj is None]


def desired_children(owner: Owner, spec: InferenceDeploymentSpec, ctx: Context,
                     serving: str | None = None) -> Children:
    """``serving``: the RayCluster the Service selects (rollout.py); default the desired one."""
    cluster = desired_cluster(owner, spec, ctx)
    serving = serving or cluster
    config_map = desired_config_map(owner, spec, cluster)
    digest = config_hash(config_map["data"]["deployment.yaml"])
    monitor = desired_pod_monitor(owner, spec) if spec.monitoring.pod_monitor and ctx.pod_monitor_crd else None
    policy = desired_network_policy(owner, spec, ctx.operator_namespace) if spec.network_policy.enabled else None
    return Children(config_map, desired_ray_cluster(owner, spec, cluster, digest, ctx.image(spec)),
                    desired_service(owner, spec, serving), policy,
                    desired_disruption_budget(owner, spec, serving), monitor)


def single_child_names(owner: Owner) -> dict[str, str]:
    """Children of which a deployment has at most one, by kind."""
    return {"PodMonitor": owner.pod_monitor, "Service": owner.service, "NetworkPolicy": owner.network_policy,
            "PodDisruptionBudget": owner.disruption_budget, "Secret": owner.ray_token_secret}
