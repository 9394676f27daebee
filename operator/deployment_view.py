"""What the cluster holds for one InferenceDeployment, read in one place (effects: API reads, /status reads).

``read_view`` lists the deployment's RayClusters (by label, owned by its uid), reads its Service (the
serving cluster is its selector), the ``/status`` of the serving and of the desired cluster's group
controller (with the API key when the spec names one), and the pods (for failed model downloads).
Planning from it is pure: ``rollout.plan_rollout`` and ``status.compute_status``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .api import InferenceDeploymentSpec
from .children import Context, desired_cluster
from .controller_client import ControllerUnreachable, fetch_status
from .kube_client import KubeClient, KubeError
from .naming import Owner
from .operator_config import OperatorConfig
from .rollout import ClusterState, RolloutPlan, plan_rollout
from .service import selected_cluster
from .status import DownloadFailure, RayClusterObservation, RolloutObservation


@dataclass
class DeploymentView:
    owner: Owner
    spec: InferenceDeploymentSpec
    desired: str  # the RayCluster the spec wants
    clusters: dict[str, dict[str, Any]]  # name -> RayCluster, the deployment's own
    serving_now: str | None  # the Service's cluster (None: no Service yet)
    controllers: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> its /status
    errors: dict[str, str] = field(default_factory=dict)  # cluster -> why its /status could not be read
    download_failure: DownloadFailure | None = None

    def serves(self, cluster: str) -> bool:
        doc = self.controllers.get(cluster)
        return doc is not None and int(doc.get("ready_replicas") or 0) >= self.spec.replicas

    def plan(self, now: datetime) -> RolloutPlan:
        states = [ClusterState.of(obj, self.serves(name)) for name, obj in sorted(self.clusters.items())]
        immediate = self.spec.suspend or self.spec.replicas == 0
        return plan_rollout(self.desired, states, self.serving_now, now,
                            self.spec.rollout.cluster_deletion_delay_seconds, immediate)

    def ray_cluster(self, name: str) -> RayClusterObservation | None:
        return RayClusterObservation.of(self.clusters.get(name))

    def rollout(self, plan: RolloutPlan) -> RolloutObservation:
        pending = plan.pending
        ready = int((self.controllers.get(pending) or {}).get("ready_replicas") or 0) if pending else 0
        return RolloutObservation(plan.serving, pending, ready)


def api_key(kube: KubeClient, owner: Owner, spec: InferenceDeploymentSpec) -> str | None:
    ref = spec.serving.api_key_secret
    return None if ref is None else kube.secret_value(owner.namespace, ref.name, ref.key)


def read_view(kube: KubeClient, config: OperatorConfig, ctx: Context, owner: Owner,
              spec: InferenceDeploymentSpec, on_status_error: Any = None) -> DeploymentView:
    """Raises ``KubeError`` when the API cannot be read (the caller decides: retry later)."""
    try:
        listed = kube.list("RayCluster", owner.namespace, owner.selector)
    except KubeError as e:
        if e.status != 404:  # no RayCluster kind (KubeRay missing): no clusters
            raise
        listed = []
    clusters = {c["metadata"]["name"]: c for c in listed if owner.owns(c)}
    view = DeploymentView(owner, spec, desired_cluster(owner, spec, ctx), clusters,
                          selected_cluster(kube.get("Service", owner.namespace, owner.service)))
    if not (spec.suspend or spec.replicas == 0):
        key = api_key(kube, owner, spec)
        for name in sorted({view.desired, view.serving_now or view.desired} & set(clusters)):
            url = config.status_url(owner.name, owner.namespace, owner.service, name, spec.serving.port)
            try:
                view.controllers[name] = fetch_status(url, api_key=key)
            except ControllerUnreachable as e:
                view.errors[name] = str(e)
                if on_status_error is not None:
                    on_status_error()
        view.download_failure = DownloadFailure.of(kube.list("Pod", owner.namespace, owner.selector))
    return view
