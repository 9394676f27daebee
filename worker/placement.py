"""Engine group -> Ray placement group (pure).

One bundle per rank: ``{"GPU": 1}`` on GPUs, a custom resource locally (``fake_gpu``: Ray
cannot fake ``GPU``). STRICT_PACK keeps a group on one node, which the fused all-reduce's IPC
workspace needs; groups larger than a node are refused for now (whole-node slices come later).
Names are ``fusedserve/<namespace>/<name>/<group>`` and the groups are detached, so a
restarted controller finds its groups again.
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_GPU_RESOURCE = "fake_gpu"


class PlacementError(ValueError):
    """An engine group that no node of this cluster could hold; the message says why."""


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: str
    lifetime: str = "detached"

    @property
    def ranks(self) -> int:
        return len(self.bundles)


def group_name(namespace: str, deployment: str, index: int) -> str:
    return f"fusedserve/{namespace}/{deployment}/{index}"


def plan_group(namespace: str, deployment: str, index: int, tp: int, gpus: bool,
               gpus_per_node: int) -> PlacementPlan:
    if tp > gpus_per_node:
        raise PlacementError(
            f"an engine group of {tp} ranks does not fit one node of {gpus_per_node} GPUs; "
            "groups larger than a node are not supported yet")
    bundle = {"GPU": 1.0, "CPU": 1.0} if gpus else {LOCAL_GPU_RESOURCE: 1.0}
    return PlacementPlan(group_name(namespace, deployment, index), tuple(dict(bundle) for _ in range(tp)),
                         "STRICT_PACK")


def explain_unschedulable(plan: PlacementPlan, available: dict[str, float]) -> str:
    """Why a placement group stays pending, from the cluster's total resources."""
    need: dict[str, float] = {}
    for b in plan.bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = [f"needs {need[k]:g} {k}, cluster has {available.get(k, 0.0):g}"
             for k in sorted(need) if available.get(k, 0.0) < need[k]]
    return "; ".join(short) or f"{plan.strategy} found no single node with {plan.ranks} free bundles"
