"""The group controller's ``/status`` document, computed from observations (pure).

Inputs are what the controller observed: each engine group's placement and phase, every rank's
``RankActor.info()`` and ``MetricsSnapshot``, the failures it recorded. Output is JSON-ready:

    {"deployment", "namespace", "model", "revision", "ready", "replicas", "ready_replicas",
     "restarts", "last_failure", "failures": [...], "conditions": [...],
     "groups": [{"index", "placement_group", "strategy", "bundles", "phase", "revision",
                 "outdated", "acceptance_length", "collectives_match_plan", "quantization",
                 "ranks": [{"rank", "role", "node", "pid", ..., "collectives": {...}}]}]}

``quantization`` is the leader's view of how the checkpoint's weights are kept (``models/quantization.py``:
checkpoint format, weights "fp8" / "dequantized" / "unquantized", a description).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..serving.engine_client import MetricsSnapshot
from ..serving.local_engine_client import group_status


@dataclass(frozen=True)
class Failure:
    group: int
    time: float
    reason: str
    kind: str  # "RankFailed", "Unschedulable", "StartFailed"

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "time": self.time, "reason": self.reason, "kind": self.kind}


@dataclass(frozen=True)
class GroupObservation:
    index: int
    name: str
    strategy: str
    bundles: tuple[dict[str, float], ...]
    phase: str
    revision: str
    ranks: tuple[dict[str, Any], ...]  # RankActor.info() per rank
    snapshots: tuple[MetricsSnapshot, ...] = ()  # every rank's, when the group is Ready
    adopted: bool = False
    error: str | None = None  # why the group's metrics could not be read


@dataclass(frozen=True)
class ControllerObservation:
    deployment: str
    namespace: str
    model: str
    revision: str
    replicas: int
    groups: tuple[GroupObservation, ...]
    failures: tuple[Failure, ...] = ()
    restarts: int = 0
    creating: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # groups being made now


def acceptance_length(snapshots: tuple[MetricsSnapshot, ...]) -> float | None:
    """1 + accepted drafts / verify steps over every engine of a group; None without speculation."""
    drafts = sum(int(s.spec.get("drafts", 0)) for s in snapshots)
    accepted = sum(int(s.spec.get("accepted_tokens", 0)) for s in snapshots)
    return 1 + accepted / drafts if drafts else None


def group_entry(g: GroupObservation, desired_revision: str) -> dict[str, Any]:
    by_rank = {s.labels.get("rank"): s for s in g.snapshots}
    ranks = []
    for info in g.ranks:
        entry = {k: v for k, v in info.items() if k != "labels"}
        snapshot = by_rank.get(str(info.get("rank")))
        if snapshot is not None:
            view = group_status(snapshot, ready=g.phase == "Ready")
            entry["collectives"] = view["collectives"]
            if info.get("role") == "leader":
                entry.update({k: view[k] for k in ("num_requests_running", "num_requests_waiting",
                                                   "kv_cache_usage", "acceptance_length")})
        ranks.append(entry)
    matches = [r["collectives"]["matches_plan"] for r in ranks if "collectives" in r]
    leader = next((r for r in g.ranks if r.get("role") == "leader"), g.ranks[0] if g.ranks else {})
    out: dict[str, Any] = {
        "index": g.index, "placement_group": g.name, "strategy": g.strategy, "bundles": list(g.bundles),
        "phase": g.phase, "ready": g.phase == "Ready", "revision": g.revision,
        "outdated": g.revision != desired_revision, "adopted": g.adopted,
        "acceptance_length": acceptance_length(g.snapshots),
        "collectives_match_plan": all(matches) if matches else None, "quantization": leader.get("quantization"),
        "ranks": ranks,
    }
    if g.error:
        out["error"] = g.error
    return out


def controller_status(obs: ControllerObservation) -> dict[str, Any]:
    groups = [group_entry(g, obs.revision) for g in sorted(obs.groups, key=lambda g: g.index)]
    ready = [g for g in groups if g["ready"]]
    conditions = [{"type": "Ready", "status": len(ready) >= max(obs.replicas, 1),
                   "message": f"{len(ready)}/{obs.replicas} engine groups ready"}]
    unschedulable = [f for f in obs.failures if f.kind == "Unschedulable"]
    if unschedulable and len(ready) < obs.replicas:
        conditions.append({"type": "Scheduled", "status": False, "reason": "Unschedulable",
                           "message": unschedulable[-1].reason})
    outdated = sum(1 for g in groups if g["outdated"])
    if obs.creating or outdated or len(groups) != obs.replicas:
        conditions.append({"type": "Progressing", "status": True,
                           "message": f"{len(obs.creating)} group(s) being created, {outdated} outdated"})
    return {
        "deployment": obs.deployment, "namespace": obs.namespace, "model": obs.model, "revision": obs.revision,
        "ready": bool(ready), "replicas": obs.replicas, "ready_replicas": len(ready),
        "updated_replicas": sum(1 for g in ready if not g["outdated"]),
        "restarts": obs.restarts,
        "last_failure": obs.failures[-1].to_json() if obs.failures else None,
        "failures": [f.to_json() for f in obs.failures[-10:]],
        "conditions": conditions, "creating": list(obs.creating), "groups": groups,
    }
