"""kopf handlers: thin effects around the pure planners (children.py, rollout.py, status.py).

- create / update / resume share one idempotent ``reconcile``: parse the spec, read what exists
  (deployment_view.py), plan the rollout, server-side apply the children (RayCluster and its engine
  ConfigMap, Service, NetworkPolicy, PodDisruptionBudget, PodMonitor when wanted and its CRD exists),
  create the Ray token Secret once, retire and delete RayClusters the rollout is done with, write status.
  An invalid spec (or a child the API server refuses as invalid) is a permanent error, visible in
  ``status.conditions`` and as a Warning Event; an API not ready (KubeRay's CRD missing, a conflict) is
  a temporary error retried after a delay.
- a timer mirrors the serving RayCluster's state and its group controller's ``/status`` into the CR and
  moves a rollout on: switches the Service to a new cluster once it serves, deletes retired ones.
- delete (kopf's finalizer) removes the children (they also carry ownerReferences for the GC).

Progress and the last-handled spec are kept in annotations (``fusedserve.io/...``), never in
``status``, so the CRD's structural schema holds and a restarted operator resumes where it was.
Run as ``fusedserve-operator`` (main.py) or ``kopf run -m fusedserve.operator.handlers``.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from typing import Any

import kopf

from fusedserve.worker.ray import auth_token
from fusedserve.worker.spec import SpecError

from .api import GROUP, PLURAL, VERSION, InferenceDeploymentSpec
from .children import CHILD_KINDS, Children, Context, desired_children, parse_spec, single_child_names
from .deployment_view import DeploymentView, read_view
from .kube_client import KubeClient, KubeError
from .metrics import OperatorMetrics
from .naming import ANNOTATION_RETIRED_AT, Owner
from .operator_config import OperatorConfig
from .pod_monitor import CRD_NAME as POD_MONITOR_CRD
from .ray_auth import desired_token_secret
from .rollout import RolloutPlan
from .service import selected_cluster
from .status import Observation, compute_status, condition_map, rfc3339

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
    settings.peering.lifetime = memo.config.peering_lifetime_s
    settings.peering.stealth = True
    memo.setdefault("metrics", OperatorMetrics())
    memo.setdefault("kube", KubeClient())
    memo.setdefault("conditions", {})  # uid -> {condition type: status}, for the deployments gauge
    memo.setdefault("ready_seen", set())  # uids whose first Ready was counted
    if memo.config.metrics_port is not None:
        memo.metrics.serve(memo.config.metrics_port, memo.config.listen_address)
        logger.info("operator metrics on :%d/metrics", memo.config.metrics_port)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _context(memo: Any) -> Context:
    kube: KubeClient = memo.kube
    return Context(pod_monitor_crd=kube.crd_exists(POD_MONITOR_CRD), worker_image=memo.config.worker_image,
                   operator_namespace=memo.config.namespace)


def _view(memo: Any, owner: Owner, spec: InferenceDeploymentSpec, ctx: Context) -> DeploymentView:
    return read_view(memo.kube, memo.config, ctx, owner, spec, on_status_error=memo.metrics.status_fetch_errors.inc)


def _observation(body: Any, view: DeploymentView | None, plan: RolloutPlan | None, applied: int | None,
                 spec_error: str | None = None) -> Observation:
    owner, generation = Owner.of(body), int(body["metadata"].get("generation") or 1)
    if view is None or plan is None:
        return Observation(owner, generation, _now(), None, spec_error, applied)
    return Observation(owner, generation, _now(), view.spec, None, applied, view.ray_cluster(plan.serving),
                       view.controllers.get(plan.serving), view.errors.get(plan.serving), view.rollout(plan),
                       view.download_failure)


def _write_status(body: Any, patch: kopf.Patch, memo: kopf.Memo, obs: Observation,
                  live: dict[str, Any] | None = None) -> None:
    """Patch the status from ``obs``: the difference to the live object's status (when read), else the body's."""
    old = dict((live if live is not None else body).get("status") or {})
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
    reason = {c["type"]: c.get("reason", "") for c in new.get("conditions", [])}
    old_reason = {c["type"]: c.get("reason", "") for c in old.get("conditions", [])}
    if after.get("Ready") == "True" and before.get("Ready") != "True":
        kopf.info(body, reason="Ready", message=message.get("Ready", ""))
        if uid not in memo.ready_seen:
            memo.ready_seen.add(uid)
            created = body["metadata"].get("creationTimestamp")
            if created:
                t0 = datetime.fromisoformat(created.replace("Z", "+00:00"))
                memo.metrics.time_to_ready.observe(max(0.0, (_now() - t0).total_seconds()))
    if after.get("Degraded") == "True" and (before.get("Degraded") != "True" or
                                            reason.get("Degraded") != old_reason.get("Degraded")):
        why = reason.get("Degraded", "")
        kopf.warn(body, reason=why if why == "ModelDownloadFailed" else "Degraded", message=message.get("Degraded", ""))
    scheduled_failed = after.get("Scheduled") == "False" and before.get("Scheduled") != "False"
    if scheduled_failed and reason.get("Scheduled") in ("Unschedulable", "ReplicaFailure"):
        kopf.warn(body, reason=reason["Scheduled"], message=message.get("Scheduled", ""))


def _live(kube: KubeClient, body: Any) -> dict[str, Any] | None:
    """The live object when ``body`` is its current generation, else None. A replica that was paused or lagged
    behind may still hold an older body (or an older status): acting on it would undo what a newer reconcile
    did (switch the Service back to a cluster being retired, write an older observedGeneration). Such a body is
    skipped, the newer one is handled on its own; status is written against the live status."""
    meta = body["metadata"]
    live = kube.get("InferenceDeployment", meta.get("namespace") or "default", meta["name"])
    current = live is not None and live["metadata"].get("generation") == meta.get("generation")
    return live if current else None


def _settled(kube: KubeClient, owner: Owner, view: DeploymentView, plan: RolloutPlan) -> RolloutPlan:
    """``plan``, unless another replica switched the Service to the desired cluster since ``view`` was read:
    then that switch stands (never move the Service back from the cluster the spec wants)."""
    if plan.serving == view.desired:
        return plan
    if selected_cluster(kube.get("Service", owner.namespace, owner.service)) == view.desired:
        return dataclasses.replace(plan, serving=view.desired, pending=None)
    return plan


def _advance(kube: KubeClient, owner: Owner, plan: RolloutPlan, logger: Any) -> dict[str, str]:
    """Retire, un-retire and delete RayClusters as the plan says (with their engine ConfigMaps)."""
    done: dict[str, str] = {}
    for name in plan.retire:
        kube.annotate("RayCluster", owner.namespace, name, {ANNOTATION_RETIRED_AT: rfc3339(_now())})
        done[f"RayCluster {name}"] = "retired"
    for name in plan.unretire:
        kube.annotate("RayCluster", owner.namespace, name, {ANNOTATION_RETIRED_AT: None})
    for name in plan.delete:
        kube.delete("RayCluster", owner.namespace, name)
        kube.delete("ConfigMap", owner.namespace, Owner.config_map(name))
        done[f"RayCluster {name}"] = "deleted"
    if done:
        logger.info("rollout: %s", ", ".join(f"{k} {v}" for k, v in sorted(done.items())))
    return done


def _apply(kube: KubeClient, owner: Owner, children: Children, ctx: Context) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    missing = kube.get("Secret", owner.namespace, owner.ray_token_secret) is None
    if missing and kube.create(desired_token_secret(owner, auth_token.new_token())):
        outcomes["Secret"] = "created"  # once: a new token would cut the running cluster in two
    for obj in children.all():
        outcomes[f"{obj['kind']} {obj['metadata']['name']}"] = kube.apply(obj)
    for kind in children.absent():
        if kind == "PodMonitor" and not ctx.pod_monitor_crd:
            continue
        if kube.delete(kind, owner.namespace, single_child_names(owner)[kind]):
            outcomes[kind] = "deleted"
    return outcomes


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: Any, patch: kopf.Patch, memo: Any, logger: Any, **_: Any) -> None:
    t0 = time.monotonic()
    owner, generation = Owner.of(body), int(body["metadata"].get("generation") or 1)
    kube: KubeClient = memo.kube

    def invalid(e: Exception) -> kopf.PermanentError:
        memo.metrics.reconciles.labels(result="permanent_error").inc()
        _write_status(body, patch, memo, _observation(body, None, None, generation, str(e)))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        return kopf.PermanentError(f"invalid spec: {e}")

    try:
        spec = parse_spec(body)
    except SpecError as e:
        raise invalid(e) from e
    try:
        live = _live(kube, body)
        if live is None:
            logger.info("generation %d is not the object's current one: skipped", generation)
            return
        ctx = _context(memo)
        view = _view(memo, owner, spec, ctx)
        plan = _settled(kube, owner, view, view.plan(_now()))
        outcomes = _apply(kube, owner, desired_children(owner, spec, ctx, plan.serving), ctx)
        outcomes.update(_advance(kube, owner, plan, logger))
        serving = kube.get("RayCluster", owner.namespace, plan.serving)  # as just applied, for the status
        if serving is not None:
            view.clusters[plan.serving] = serving
    except KubeError as e:
        if e.status == 422:  # a child the API server refuses (e.g. an affinity KubeRay's schema rejects)
            raise invalid(SpecError(f"the API server refused a child: {e}")) from e
        memo.metrics.reconciles.labels(result="temporary_error").inc()
        hint = " (is KubeRay installed? the RayCluster kind was not found)" if e.status == 404 else ""
        raise kopf.TemporaryError(f"applying children: {e}{hint}", delay=memo.config.retry_delay_s) from e
    changed = {k: v for k, v in outcomes.items() if v != "unchanged"}
    if changed:
        text = ", ".join(f"{kind} {v}" for kind, v in sorted(changed.items()))
        kopf.info(body, reason="Reconciled", message=f"generation {generation}: {text}")
        logger.info("generation %d: %s", generation, text)
    _write_status(body, patch, memo, _observation(body, view, plan, generation), live)
    memo.metrics.reconciles.labels(result="success").inc()
    memo.metrics.reconcile_duration.observe(time.monotonic() - t0)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STARTUP_CONFIG.status_interval_s,
            initial_delay=min(1.0, STARTUP_CONFIG.status_interval_s))
def mirror_status(body: Any, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    owner = Owner.of(body)
    kube: KubeClient = memo.kube
    try:
        live = _live(kube, body)
    except KubeError as e:
        raise kopf.TemporaryError(f"mirroring status: {e}", delay=memo.config.retry_delay_s) from e
    if live is None:
        return
    applied = (live.get("status") or {}).get("observedGeneration")
    try:
        spec = parse_spec(body)
    except SpecError as e:
        _write_status(body, patch, memo, _observation(body, None, None, applied, str(e)), live)
        return
    try:
        ctx = _context(memo)
        view = _view(memo, owner, spec, ctx)
        plan = _settled(kube, owner, view, view.plan(_now()))
        if applied == body["metadata"].get("generation") and plan.serving != view.serving_now:
            children = desired_children(owner, spec, ctx, plan.serving)  # switch the Service (and the budget)
            for obj in (children.service, children.disruption_budget):
                if obj is not None:
                    kube.apply(obj)
            kopf.info(body, reason="RolloutSwitched", message=f"the Service now selects RayCluster {plan.serving}")
            view.serving_now = plan.serving
        if applied == body["metadata"].get("generation"):
            _advance(kube, owner, plan, logger)
    except KubeError as e:
        raise kopf.TemporaryError(f"mirroring status: {e}", delay=memo.config.retry_delay_s) from e
    _write_status(body, patch, memo, _observation(body, view, plan, applied), live)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(body: Any, memo: Any, logger: Any, **_: Any) -> None:
    owner = Owner.of(body)
    kube: KubeClient = memo.kube
    gone: list[str] = []
    try:
        for kind in CHILD_KINDS:
            try:
                found = [o for o in kube.list(kind, owner.namespace, owner.selector) if owner.owns(o)]
            except KubeError as e:
                if e.status == 404:  # the kind does not exist here (no Prometheus Operator, no KubeRay)
                    continue
                raise
            gone += [f"{kind} {o['metadata']['name']}" for o in found
                     if kube.delete(kind, owner.namespace, o["metadata"]["name"])]
    except KubeError as e:
        raise kopf.TemporaryError(f"deleting children: {e}", delay=memo.config.retry_delay_s) from e
    memo.conditions.pop(body["metadata"].get("uid", ""), None)
    memo.metrics.set_deployments(memo.conditions.values())
    logger.info("deleted %s", ", ".join(gone) or "nothing (no children left)")
