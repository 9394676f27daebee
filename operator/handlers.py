"""kopf handlers: thin effects around the pure planners (children.py, status.py).

- create / update / resume share one idempotent ``reconcile``: parse the spec, apply the children
  (RayCluster, engine ConfigMap, Service, PodMonitor when wanted and its CRD exists), write status.
  An invalid spec is a permanent error, visible in ``status.conditions`` and as a Warning Event;
  an API not ready (KubeRay's CRD missing, a conflict) is a temporary error retried after a delay.
- a timer mirrors the RayCluster's state and the group controller's ``/status`` into the CR.
- delete (kopf's finalizer) removes the children (they also carry ownerReferences for the GC).

Progress and the last-handled spec are kept in annotations (``fusedserve.io/...``), never in
``status``, so the CRD's structural schema holds and a restarted operator resumes where it was.
Run as ``fusedserve-operator`` (main.py) or ``kopf run -m fusedserve.operator.handlers``.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import kopf

from fusedserve.worker.spec import SpecError

from .api import GROUP, PLURAL, VERSION
from .children import CHILD_KINDS, child_names, desired_children, parse_spec
from .controller_client import ControllerUnreachable, fetch_status
from .kube_client import KubeClient, KubeError
from .metrics import OperatorMetrics
from .naming import Owner
from .operator_config import OperatorConfig
from .pod_monitor import CRD_NAME as POD_MONITOR_CRD
from .status import Observation, RayClusterObservation, compute_status, condition_map

STARTUP_CONFIG = OperatorConfig.from_env()  # the timer's interval is fixed when the handlers are declared
PREFIX = "fusedserve.io"


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """The pod's service account in a cluster, else the kubeconfig named by $KUBECONFIG (read now)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, logger: Any, **_: Any) -> None:
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX)
    settings.watching.server_timeout = 300
    memo.setdefault("config", OperatorConfig.from_env())
    memo.setdefault("metrics", OperatorMetrics())
    memo.setdefault("kube", KubeClient())
    memo.setdefault("conditions", {})  # uid -> {condition type: status}, for the deployments gauge
    memo.setdefault("ready_seen", set())  # uids whose first Ready was counted
    if memo.config.metrics_port is not None:
        memo.metrics.serve(memo.config.metrics_port, memo.config.listen_address)
        logger.info("operator metrics on :%d/metrics", memo.config.metrics_port)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _observe(memo: kopf.Memo, body: Any, applied_generation: int | None) -> Observation:
    """Read the RayCluster and the group controller's /status (effects), into one Observation."""
    owner, generation = Owner.of(body), int(body["metadata"].get("generation") or 1)
    try:
        spec = parse_spec(body)
    except SpecError as e:
        return Observation(owner, generation, _now(), None, str(e), applied_generation)
    kube: KubeClient = memo.kube
    ray_cluster = RayClusterObservation.of(kube.get("RayCluster", owner.namespace, owner.ray_cluster))
    controller, error = None, None
    if not (spec.suspend or spec.replicas == 0):
        url = memo.config.status_url(owner.name, owner.namespace, owner.service, spec.serving.port)
        try:
            controller = fetch_status(url)
        except ControllerUnreachable as e:
            memo.metrics.status_fetch_errors.inc()
            error = str(e)
    return Observation(owner, generation, _now(), spec, None, applied_generation, ray_cluster, controller, error)


def _write_status(body: Any, patch: kopf.Patch, memo: kopf.Memo, obs: Observation) -> None:
    old = dict(body.get("status") or {})
    new = compute_status(obs, old)
    for key in old.keys() - new.keys():
        patch.status[key] = None
    for key, value in new.items():
        if old.get(key) != value:
            patch.status[key] = value
    _announce(body, memo, old, new)


def _announce(body: Any, memo: kopf.Memo, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Events for transitions, the deployments gauge, time to Ready."""
    uid = body["metadata"].get("uid", "")
    before, after = condition_map(old), condition_map(new)
    memo.conditions[uid] = after
    memo.metrics.set_deployments(memo.conditions.values())
    message = {c["type"]: c.get("message", "") for c in new.get("conditions", [])}
    if after.get("Ready") == "True" and before.get("Ready") != "True":
        kopf.info(body, reason="Ready", message=message.get("Ready", ""))
        if uid not in memo.ready_seen:
            memo.ready_seen.add(uid)
            created = body["metadata"].get("creationTimestamp")
            if created:
                t0 = datetime.fromisoformat(created.replace("Z", "+00:00"))
                memo.metrics.time_to_ready.observe(max(0.0, (_now() - t0).total_seconds()))
    if after.get("Degraded") == "True" and before.get("Degraded") != "True":
        kopf.warn(body, reason="Degraded", message=message.get("Degraded", ""))
    if after.get("Scheduled") == "False" and before.get("Scheduled") != "False":
        reason = next(c["reason"] for c in new["conditions"] if c["type"] == "Scheduled")
        if reason in ("Unschedulable", "ReplicaFailure"):
            kopf.warn(body, reason=reason, message=message.get("Scheduled", ""))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: Any, patch: kopf.Patch, memo: Any, logger: Any, **_: Any) -> None:
    t0 = time.monotonic()
    owner, generation = Owner.of(body), int(body["metadata"].get("generation") or 1)
    try:
        spec = parse_spec(body)
    except SpecError as e:
        memo.metrics.reconciles.labels(result="permanent_error").inc()
        _write_status(body, patch, memo, Observation(owner, generation, _now(), None, str(e), generation))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    kube: KubeClient = memo.kube
    try:
        monitor_crd = kube.crd_exists(POD_MONITOR_CRD)
        children = desired_children(owner, spec, monitor_crd)
        outcomes = {obj["kind"]: kube.apply(obj) for obj in children.all()}
        stale_monitor = children.pod_monitor is None and monitor_crd  # monitoring turned off
        if stale_monitor and kube.delete("PodMonitor", owner.namespace, owner.pod_monitor):
            outcomes["PodMonitor"] = "deleted"  # type: ignore[assignment]
    except KubeError as e:
        memo.metrics.reconciles.labels(result="temporary_error").inc()
        hint = " (is KubeRay installed? the RayCluster kind was not found)" if e.status == 404 else ""
        raise kopf.TemporaryError(f"applying children: {e}{hint}", delay=memo.config.retry_delay_s) from e
    changed = {k: v for k, v in outcomes.items() if v != "unchanged"}
    if changed:
        text = ", ".join(f"{kind} {v}" for kind, v in sorted(changed.items()))
        kopf.info(body, reason="Reconciled", message=f"generation {generation}: {text}")
        logger.info("generation %d: %s", generation, text)
    _write_status(body, patch, memo, _observe(memo, body, generation))
    memo.metrics.reconciles.labels(result="success").inc()
    memo.metrics.reconcile_duration.observe(time.monotonic() - t0)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STARTUP_CONFIG.status_interval_s,
            initial_delay=min(1.0, STARTUP_CONFIG.status_interval_s))
def mirror_status(body: Any, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    applied = (body.get("status") or {}).get("observedGeneration")
    _write_status(body, patch, memo, _observe(memo, body, applied))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(body: Any, memo: Any, logger: Any, **_: Any) -> None:
    owner = Owner.of(body)
    names = child_names(owner)
    kube: KubeClient = memo.kube
    try:
        gone = [kind for kind in CHILD_KINDS if kube.delete(kind, owner.namespace, names[kind])]
    except KubeError as e:
        raise kopf.TemporaryError(f"deleting children: {e}", delay=memo.config.retry_delay_s) from e
    memo.conditions.pop(body["metadata"].get("uid", ""), None)
    memo.metrics.set_deployments(memo.conditions.values())
    logger.info("deleted %s", ", ".join(gone) or "nothing (no children left)")
