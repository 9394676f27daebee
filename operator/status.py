"""An InferenceDeployment's status from what the operator observed (pure: the clock is an input).

Inputs: the object's generation and parsed spec (or why it is invalid), the generation whose
children were last applied, the RayCluster's status, and the group controller's ``/status``
document (or why it could not be read). Output: the whole ``status`` (camelCase, as the CRD has it),
written once per observation. Conditions follow metav1.Condition: ``lastTransitionTime`` changes
only when a condition's status changes; every condition carries the observed generation.

    Ready        True when every desired engine group serves (readyReplicas >= replicas > 0)
    Scheduled    True when the RayCluster's worker pods are up; False/Unschedulable with the reason
    Progressing  True while children are being applied or engine groups created or rolled
    Degraded     True when a group is down, a rank failed in the last few minutes, or a model download fails

During a rollout to a new RayCluster (rollout.py) the engine figures are the serving cluster's, and
Progressing says how far the new one is. A model download that fails (an init container that exited
non-zero, retried by the kubelet with backoff) shows as reason ``ModelDownloadFailed`` with its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .api import InferenceDeploymentSpec
from .model_source import INIT_CONTAINER
from .naming import Owner
from .service import endpoint

DEGRADED_WINDOW_S = 300.0  # a rank failure this recent marks the deployment Degraded


@dataclass(frozen=True)
class RayClusterObservation:
    state: str | None  # KubeRay's status.state: "ready", "suspended", ...
    desired_workers: int
    ready_workers: int
    failure: str | None = None  # a ReplicaFailure condition's message

    @classmethod
    def of(cls, obj: dict[str, Any] | None) -> RayClusterObservation | None:
        if obj is None:
            return None
        st = obj.get("status") or {}
        failure = next((c.get("message") or c.get("reason") for c in st.get("conditions") or []
                        if c.get("type") == "ReplicaFailure" and c.get("status") == "True"), None)
        desired = st.get("desiredWorkerReplicas")
        if desired is None:
            desired = sum(int(g.get("replicas", 0)) for g in (obj.get("spec") or {}).get("workerGroupSpecs") or [])
        return cls(st.get("state"), int(desired), int(st.get("readyWorkerReplicas") or 0), failure)


@dataclass(frozen=True)
class DownloadFailure:
    pod: str
    message: str
    restarts: int

    @classmethod
    def of(cls, pods: list[dict[str, Any]]) -> DownloadFailure | None:
        """The first pod whose model download failed (its init container exited non-zero), if any."""
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            for st in (pod.get("status") or {}).get("initContainerStatuses") or []:
                if st.get("name") != INIT_CONTAINER:
                    continue
                for state in (st.get("state") or {}, st.get("lastState") or {}):
                    done = state.get("terminated") or {}
                    if done and int(done.get("exitCode") or 0) != 0:
                        message = str(done.get("message") or done.get("reason") or "exit code "
                                      f"{done.get('exitCode')}").strip().splitlines()
                        return cls(pod["metadata"]["name"], (message[-1] if message else "")[:1024],
                                   int(st.get("restartCount") or 0))
        return None

    def text(self) -> str:
        return (f"pod {self.pod}: {self.message} (retried with backoff by the kubelet, {self.restarts} "
                f"restart(s) so far)")


@dataclass(frozen=True)
class RolloutObservation:
    serving: str | None  # the RayCluster the Service selects
    pending: str | None = None  # a new RayCluster coming up
    pending_ready: int = 0  # its engine groups ready


@dataclass(frozen=True)
class Observation:
    owner: Owner
    generation: int
    now: datetime
    spec: InferenceDeploymentSpec | None  # None when the spec is invalid
    spec_error: str | None = None
    applied_generation: int | None = None  # children applied for this generation
    ray_cluster: RayClusterObservation | None = None
    controller: dict[str, Any] | None = None  # the serving cluster's group controller's /status
    controller_error: str | None = None
    rollout: RolloutObservation | None = None
    download_failure: DownloadFailure | None = None


def rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(type_: str, status: bool | None, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": {True: "True", False: "False", None: "Unknown"}[status],
            "reason": reason, "message": message[:32768]}


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]], now: datetime,
                     generation: int) -> list[dict[str, Any]]:
    """``new`` with each condition's lastTransitionTime kept from ``old`` where its status is unchanged."""
    before = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c["type"])
        since = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "observedGeneration": generation, "lastTransitionTime": since or rfc3339(now)})
    return out


def _groups(controller: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in controller.get("groups") or []:
        nodes = sorted({str(r["node"]) for r in g.get("ranks") or [] if r.get("node")})
        out.append({"index": int(g.get("index", 0)), "revision": str(g.get("revision", ""))[:63],
                    "phase": g.get("phase") if g.get("phase") in ("Pending", "Starting", "Ready", "Failed",
                                                                   "Terminating") else "Pending",
                    "nodes": nodes[:64]})
    return out[:128]


def _acceptance(controller: dict[str, Any]) -> str | None:
    values = [g["acceptance_length"] for g in controller.get("groups") or []
              if isinstance(g.get("acceptance_length"), (int, float))]
    return f"{sum(values) / len(values):.2f}" if values else None


def _quantization(controller: dict[str, Any]) -> dict[str, Any] | None:
    """The first group's (every group loads the same checkpoint the same way), camelCase."""
    for g in controller.get("groups") or []:
        q = g.get("quantization")
        if isinstance(q, dict) and q.get("weights") in ("fp8", "dequantized", "unquantized"):
            out = {"checkpoint": q.get("checkpoint") if q.get("checkpoint") == "fp8" else None,
                   "weights": q["weights"], "weightBlockSize": q.get("weight_block_size"),
                   "description": str(q.get("description", ""))[:256]}
            return {k: v for k, v in out.items() if v is not None}
    return None


def _scheduled(obs: Observation) -> dict[str, Any]:
    for c in (obs.controller or {}).get("conditions") or []:
        if c.get("type") == "Scheduled" and c.get("status") is False:
            return _cond("Scheduled", False, "Unschedulable", str(c.get("message", "")))
    rc = obs.ray_cluster
    if rc is None:
        return _cond("Scheduled", False, "RayClusterPending", "the RayCluster does not exist yet")
    if rc.failure:
        return _cond("Scheduled", False, "ReplicaFailure", rc.failure)
    if rc.ready_workers >= rc.desired_workers:
        return _cond("Scheduled", True, "PodsReady", f"{rc.ready_workers}/{rc.desired_workers} worker pods ready")
    return _cond("Scheduled", False, "WaitingForPods", f"{rc.ready_workers}/{rc.desired_workers} worker pods ready")


def _engine_conditions(obs: Observation, spec: InferenceDeploymentSpec, ready: int,
                       controller: dict[str, Any] | None) -> list[dict[str, Any]]:
    want = spec.replicas
    behind = obs.applied_generation != obs.generation
    failed_download = obs.download_failure
    rollout = obs.rollout
    if controller is None:
        why = obs.controller_error or "not read yet"
        if failed_download is not None:
            ready_c = _cond("Ready", False, "ModelDownloadFailed", failed_download.text())
        else:
            ready_c = _cond("Ready", None, "ControllerUnreachable", f"the group controller's /status: {why}")
        progressing = _cond("Progressing", True, "ControllerStarting", "waiting for the group controller")
        degraded = (_cond("Degraded", True, "ModelDownloadFailed", failed_download.text())
                    if failed_download is not None else _cond("Degraded", False, "AsExpected"))
        return [ready_c, progressing, degraded]
    ok = ready >= want
    ready_c = _cond("Ready", ok, "EngineGroupsReady" if ok else "EngineGroupsStarting",
                    f"{ready}/{want} engine groups ready")
    creating = len(controller.get("creating") or [])
    outdated = sum(1 for g in controller.get("groups") or [] if g.get("outdated"))
    if behind:
        progressing = _cond("Progressing", True, "Reconciling", "applying the spec's generation")
    elif rollout is not None and rollout.pending is not None:
        progressing = _cond("Progressing", True, "ClusterRollout",
                            f"RayCluster {rollout.pending} coming up ({rollout.pending_ready}/{want} engine groups "
                            f"ready); the Service stays on {rollout.serving} until it serves")
    elif creating or outdated or len(controller.get("groups") or []) != want:
        progressing = _cond("Progressing", True, "RollingUpdate",
                            f"{creating} group(s) being created, {outdated} outdated")
    elif not ok:
        progressing = _cond("Progressing", True, "EngineGroupsStarting", f"{ready}/{want} engine groups ready")
    else:
        progressing = _cond("Progressing", False, "RolloutComplete", f"{want} engine groups at the current revision")
    failure: dict[str, Any] = controller.get("last_failure") or {}
    ago = obs.now.timestamp() - float(failure.get("time", 0))
    recent = bool(failure) and ago < DEGRADED_WINDOW_S
    failed = [g for g in controller.get("groups") or [] if g.get("phase") == "Failed"]
    if failed_download is not None:
        degraded = _cond("Degraded", True, "ModelDownloadFailed", failed_download.text())
    elif failed or (recent and not ok):
        why = str(failure["reason"]) if failure else f"group {failed[0].get('index')} failed"
        degraded = _cond("Degraded", True, str(failure.get("kind", "GroupFailed")), why)
    elif recent:
        degraded = _cond("Degraded", True, "RecoveredFromFailure",
                         f"{failure.get('kind')} {int(ago)}s ago: {failure.get('reason')}")
    else:
        degraded = _cond("Degraded", False, "AsExpected")
    return [ready_c, progressing, degraded]


def compute_status(obs: Observation, old: dict[str, Any] | None) -> dict[str, Any]:
    old = old or {}
    gen = obs.generation
    status: dict[str, Any] = {
        "observedGeneration": obs.applied_generation if obs.applied_generation is not None else
        old.get("observedGeneration"),
        "selector": obs.owner.selector,
    }
    spec = obs.spec
    if spec is None:
        conds = [_cond("Ready", False, "InvalidSpec", obs.spec_error or "invalid spec"),
                 _cond("Progressing", False, "InvalidSpec", obs.spec_error or "invalid spec"),
                 _cond("Scheduled", None, "InvalidSpec"), _cond("Degraded", False, "InvalidSpec")]
        keep: dict[str, Any] = {k: old[k] for k in ("replicas", "readyReplicas", "updatedReplicas", "groups")
                                if k in old}
        status.update({"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0, **keep})
    elif spec.suspend or spec.replicas == 0:
        reason = "Suspended" if spec.suspend else "ScaledToZero"
        conds = [_cond("Ready", False, reason, "no engine groups are wanted"),
                 _cond("Progressing", False, reason), _cond("Scheduled", None, reason),
                 _cond("Degraded", False, reason)]
        status.update({"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0, "groups": []})
        status["endpoint"] = endpoint(obs.owner, spec)
    else:
        ctl = obs.controller
        if ctl is not None:
            ready, groups = int(ctl.get("ready_replicas", 0)), _groups(ctl)
            status.update({"replicas": len(groups), "readyReplicas": ready,
                           "updatedReplicas": int(ctl.get("updated_replicas", 0)), "groups": groups})
            accept = _acceptance(ctl)
            if accept is not None:
                status["speculative"] = {"acceptanceLength": accept}
            quant = _quantization(ctl)
            if quant is not None:
                status["quantization"] = quant
        else:  # keep what was last seen; Ready turns Unknown
            ready = 0
            status.update({k: old.get(k, 0) for k in ("replicas", "readyReplicas", "updatedReplicas")})
            status["groups"] = old.get("groups", [])
        if "speculative" not in status and old.get("speculative") and spec.speculative is not None:
            status["speculative"] = old["speculative"]
        if "quantization" not in status and old.get("quantization"):
            status["quantization"] = old["quantization"]
        status["endpoint"] = endpoint(obs.owner, spec)
        if obs.rollout is not None:
            status["rayCluster"] = obs.rollout.serving
            status["pendingRayCluster"] = obs.rollout.pending
        engine = _engine_conditions(obs, spec, ready, ctl)
        conds = [engine[0], _scheduled(obs), *engine[1:]]
    status["conditions"] = merge_conditions(old.get("conditions") or [], conds, obs.now, gen)
    return {k: v for k, v in status.items() if v is not None}


def condition_map(status: dict[str, Any] | None) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (status or {}).get("conditions") or [] if "type" in c}
