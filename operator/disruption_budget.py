"""The PodDisruptionBudget of a deployment (pure): voluntary disruptions (node drains) take its serving
RayCluster's pods one at a time (``podDisruptionBudget.maxUnavailable``).

KubeRay's RayCluster has no scale subresource, so the disruption controller cannot count its pods for
``maxUnavailable``: the budget is an integer ``minAvailable`` = the cluster's pods (head + workers)
minus the allowed disruptions. None when nothing is wanted (suspended, scaled to zero, disabled).
"""

from __future__ import annotations

from typing import Any

from .api import InferenceDeploymentSpec
from .naming import LABEL_CLUSTER, Owner
from .ray_cluster import worker_sizing


def desired_disruption_budget(owner: Owner, spec: InferenceDeploymentSpec, ray_cluster: str) -> dict[str, Any] | None:
    if not spec.pod_disruption_budget.enabled or spec.suspend or spec.replicas == 0:
        return None
    pods = 1 + worker_sizing(spec).pods
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": owner.metadata(owner.disruption_budget, "disruption-budget"),
        "spec": {"minAvailable": max(0, pods - spec.pod_disruption_budget.max_unavailable),
                 "selector": {"matchLabels": {**owner.pod_labels(), LABEL_CLUSTER: ray_cluster}}},
    }
