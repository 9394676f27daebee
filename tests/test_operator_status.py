"""The operator's status planner: conditions from observations, transition times, kept values."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from fusedserve.operator.api import InferenceDeploymentStatus
from fusedserve.operator.children import parse_spec
from fusedserve.operator.naming import Owner
from fusedserve.operator.status import Observation, RayClusterObservation, compute_status, condition_map

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
BODY = yaml.safe_load((REPO / "examples" / "02-tiny-code-tp2.yaml").read_text())
OWNER = Owner.of(BODY)
SPEC = parse_spec(BODY)
RAY_READY = RayClusterObservation("ready", desired_workers=1, ready_workers=1)


def controller(ready: int, groups: int = 1, accept: float | None = 2.5, **extra: Any) -> dict[str, Any]:
    return {
        "ready": ready > 0, "replicas": groups, "ready_replicas": ready, "updated_replicas": ready,
        "groups": [{"index": i, "phase": "Ready" if i < ready else "Starting", "revision": "abc123",
                    "outdated": False, "acceptance_length": accept,
                    "ranks": [{"rank": 0, "node": "node-a"}, {"rank": 1, "node": "node-a"}]}
                   for i in range(groups)],
        "conditions": [], "creating": [], "last_failure": None, **extra,
    }


def observe(now: datetime = T0, **kw: Any) -> Observation:
    base: dict[str, Any] = {"owner": OWNER, "generation": 3, "now": now, "spec": SPEC, "applied_generation": 3,
                            "ray_cluster": RAY_READY}
    base.update(kw)
    return Observation(**base)


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready_deployment_status_fits_the_crd_types() -> None:
    st = compute_status(observe(controller=controller(1)), None)
    InferenceDeploymentStatus.model_validate(st)  # the CRD's own types
    assert conds(st) == {"Ready": ("True", "EngineGroupsReady"), "Scheduled": ("True", "PodsReady"),
                         "Progressing": ("False", "RolloutComplete"), "Degraded": ("False", "AsExpected")}
    assert st["readyReplicas"] == 1 and st["replicas"] == 1 and st["observedGeneration"] == 3
    assert st["speculative"] == {"acceptanceLength": "2.50"}
    assert st["selector"] == "fusedserve.io/deployment=tiny-code-tp2"
    assert st["endpoint"] == "http://tiny-code-tp2.default.svc:8001/v1"
    assert st["groups"] == [{"index": 0, "revision": "abc123", "phase": "Ready", "nodes": ["node-a"]}]
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_transition_time_changes_only_when_a_condition_changes() -> None:
    first = compute_status(observe(controller=controller(0)), None)
    later = compute_status(observe(T0 + timedelta(seconds=30), controller=controller(0)), first)
    ready = compute_status(observe(T0 + timedelta(seconds=60), controller=controller(1)), later)
    times = [{c["type"]: c["lastTransitionTime"] for c in s["conditions"]} for s in (first, later, ready)]
    assert times[0] == times[1]  # nothing changed
    assert times[2]["Ready"] == "2026-11-30T12:01:00Z" and times[2]["Scheduled"] == times[0]["Scheduled"]
    assert times[2]["Progressing"] != times[0]["Progressing"]  # True (creating) -> False


def test_invalid_spec_is_reported_and_keeps_what_was_seen() -> None:
    ready = compute_status(observe(controller=controller(1)), None)
    bad = compute_status(observe(spec=None, spec_error="spec.replicas: must be >= 0", applied_generation=None,
                                 generation=4), ready)
    assert conds(bad)["Ready"] == ("False", "InvalidSpec")
    assert "spec.replicas" in next(c["message"] for c in bad["conditions"] if c["type"] == "Ready")
    assert bad["observedGeneration"] == 3 and bad["readyReplicas"] == 1  # the last good generation's


def test_unreachable_controller_keeps_counts_and_turns_ready_unknown() -> None:
    ready = compute_status(observe(controller=controller(1)), None)
    lost = compute_status(observe(controller_error="connection refused"), ready)
    assert conds(lost)["Ready"] == ("Unknown", "ControllerUnreachable")
    assert lost["readyReplicas"] == 1 and lost["speculative"] == {"acceptanceLength": "2.50"}


def test_unschedulable_and_waiting_for_pods() -> None:
    unsched = controller(0, conditions=[{"type": "Scheduled", "status": False, "reason": "Unschedulable",
                                         "message": "group needs 2 GPUs on one node; nodes have 1"}])
    st = compute_status(observe(controller=unsched), None)
    assert conds(st)["Scheduled"] == ("False", "Unschedulable")
    waiting = compute_status(observe(ray_cluster=RayClusterObservation(None, 2, 1), controller=controller(0)), None)
    assert conds(waiting)["Scheduled"] == ("False", "WaitingForPods")
    missing = compute_status(observe(ray_cluster=None, controller_error="no route"), None)
    assert conds(missing)["Scheduled"] == ("False", "RayClusterPending")


def test_rolling_and_reconciling_are_progressing() -> None:
    rolling = controller(1, creating=[{"index": 1}])
    assert conds(compute_status(observe(controller=rolling), None))["Progressing"] == ("True", "RollingUpdate")
    behind = observe(controller=controller(1), generation=4, applied_generation=3)
    assert conds(compute_status(behind, None))["Progressing"] == ("True", "Reconciling")


def test_a_recent_rank_failure_degrades_then_clears() -> None:
    failure = {"group": 0, "time": T0.timestamp() - 20, "reason": "rank 1 died", "kind": "RankFailed"}
    down = compute_status(observe(controller=controller(0, last_failure=failure)), None)
    assert conds(down)["Degraded"] == ("True", "RankFailed") and conds(down)["Ready"][0] == "False"
    back = compute_status(observe(T0 + timedelta(seconds=30), controller=controller(1, last_failure=failure)), down)
    assert conds(back)["Degraded"] == ("True", "RecoveredFromFailure")
    later = compute_status(observe(T0 + timedelta(minutes=10), controller=controller(1, last_failure=failure)), back)
    assert conds(later)["Degraded"] == ("False", "AsExpected")


def test_suspended_and_scaled_to_zero() -> None:
    body = {**BODY, "spec": {**BODY["spec"], "suspend": True}}
    st = compute_status(observe(spec=parse_spec(body)), None)
    assert conds(st)["Ready"] == ("False", "Suspended") and st["replicas"] == 0
    body = {**BODY, "spec": {**BODY["spec"], "replicas": 0}}
    assert conds(compute_status(observe(spec=parse_spec(body)), None))["Ready"] == ("False", "ScaledToZero")


def test_ray_cluster_observation_reads_kuberay_status() -> None:
    obj = {"spec": {"workerGroupSpecs": [{"replicas": 2}]},
           "status": {"state": "ready", "readyWorkerReplicas": 1,
                      "conditions": [{"type": "ReplicaFailure", "status": "True", "message": "quota exceeded"}]}}
    assert RayClusterObservation.of(obj) == RayClusterObservation("ready", 2, 1, "quota exceeded")
    assert RayClusterObservation.of(None) is None
    assert condition_map({"conditions": [{"type": "Ready", "status": "True"}]}) == {"Ready": "True"}


def test_quantization_is_mirrored_from_the_controller_and_kept() -> None:
    """status.quantization: how the engine groups keep a block-FP8 checkpoint's weights (kubectl get -o wide)."""
    quant = {"requested": "auto", "checkpoint": "fp8", "weight_block_size": [128, 128], "weights": "dequantized",
             "description": "fp8 e4m3, 128x128 weight blocks, 1x128 dynamic activation groups: dequantized to "
                            "float32 at load"}
    ctl = controller(1)
    ctl["groups"][0]["quantization"] = quant
    st = compute_status(observe(controller=ctl), None)
    InferenceDeploymentStatus.model_validate(st)
    assert st["quantization"] == {"checkpoint": "fp8", "weights": "dequantized", "weightBlockSize": [128, 128],
                                  "description": quant["description"]}
    lost = compute_status(observe(controller=None, controller_error="timeout"), st)
    assert lost["quantization"] == st["quantization"]
    plain = compute_status(observe(controller=controller(1)), None)
    assert "quantization" not in plain
