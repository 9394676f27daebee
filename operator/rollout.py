"""Which RayCluster serves while a change that needs new pods rolls out (pure; like KubeRay's RayService).

A deployment's desired RayCluster is named by its pod revision (naming.py, ray_cluster.pod_revision).
When the spec changes what the pods are (image, resources, placement, model source, pod settings, Ray
version), the desired cluster is a new one: it is created beside the one serving, the Service keeps
selecting the old one until the new cluster's group controller serves every wanted engine group, then
the Service is switched, and the old cluster is retired (annotated with the time) and deleted
``rollout.clusterDeletionDelaySeconds`` later, so requests already routed to it finish. Changes of the
engine config alone roll engine groups inside the serving cluster, as before.

Everything needed to continue is in the cluster itself (the Service's selector, the clusters' names and
their retired-at annotation), so a restarted or second operator takes a rollout up where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .naming import ANNOTATION_RETIRED_AT


@dataclass(frozen=True)
class ClusterState:
    name: str
    serves: bool  # its group controller serves every wanted engine group
    retired_at: datetime | None = None

    @classmethod
    def of(cls, obj: dict[str, Any], serves: bool) -> ClusterState:
        stamp = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RETIRED_AT)
        try:
            retired = datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None
        except ValueError:
            retired = None
        return cls(obj["metadata"]["name"], serves, retired)


@dataclass(frozen=True)
class RolloutPlan:
    serving: str  # the RayCluster the Service selects
    pending: str | None  # the desired cluster while it does not serve yet
    retire: tuple[str, ...] = ()  # annotate retired-at = now
    unretire: tuple[str, ...] = ()  # wanted again: drop the annotation
    delete: tuple[str, ...] = ()

    @property
    def done(self) -> bool:
        return self.pending is None and not (self.retire or self.delete)


def plan_rollout(desired: str, clusters: list[ClusterState], serving_now: str | None, now: datetime,
                 delay_s: float, immediate: bool) -> RolloutPlan:
    """``clusters``: the deployment's RayClusters that exist; ``serving_now``: the Service's cluster;
    ``immediate``: nothing needs to keep serving (suspended, zero replicas): switch and delete at once."""
    by_name = {c.name: c for c in clusters}
    keep_old = not immediate and serving_now in by_name and serving_now != desired
    new_serves = desired in by_name and by_name[desired].serves
    serving = serving_now if keep_old and not new_serves and serving_now is not None else desired
    others = [c for c in clusters if c.name not in (serving, desired)]
    due = [c.name for c in others if immediate or delay_s <= 0 or
           (c.retired_at is not None and now >= c.retired_at + timedelta(seconds=delay_s))]
    retire = [c.name for c in others if c.retired_at is None and c.name not in due]
    unretire = [n for n in (serving, desired) if n in by_name and by_name[n].retired_at is not None]
    return RolloutPlan(serving, desired if serving != desired else None, tuple(sorted(retire)),
                       tuple(sorted(set(unretire))), tuple(sorted(due)))
