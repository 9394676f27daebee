"""Rollouts that need new pods (a new RayCluster, switched to once it serves) and what status says of them;
failed model downloads; the bounded /status read."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusedserve.operator.children import parse_spec
from fusedserve.operator.controller_client import ControllerUnreachable, fetch_status
from fusedserve.operator.naming import Owner
from fusedserve.operator.rollout import ClusterState, plan_rollout
from fusedserve.operator.status import (
    DownloadFailure,
    Observation,
    RayClusterObservation,
    RolloutObservation,
    compute_status,
)

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)
REPO = Path(__file__).resolve().parents[1]


def plan(clusters: list[ClusterState], serving: str | None, now: datetime = T0, delay: float = 60,
         immediate: bool = False, desired: str = "d-new") -> Any:
    return plan_rollout(desired, clusters, serving, now, delay, immediate)


def test_first_cluster_serves_at_once() -> None:
    p = plan([], None)
    assert (p.serving, p.pending, p.delete, p.retire) == ("d-new", None, (), ())
    assert p.done


def test_the_service_stays_on_the_old_cluster_until_the_new_one_serves() -> None:
    old = ClusterState("d-old", serves=True)
    coming = plan([old, ClusterState("d-new", serves=False)], "d-old")
    assert (coming.serving, coming.pending, coming.retire, coming.delete) == ("d-old", "d-new", (), ())
    switched = plan([old, ClusterState("d-new", serves=True)], "d-old")
    assert (switched.serving, switched.pending, switched.retire, switched.delete) == ("d-new", None, ("d-old",), ())
    retired = ClusterState("d-old", serves=True, retired_at=T0)
    waiting = plan([retired, ClusterState("d-new", serves=True)], "d-new", now=T0 + timedelta(seconds=59))
    assert (waiting.retire, waiting.delete) == ((), ())
    due = plan([retired, ClusterState("d-new", serves=True)], "d-new", now=T0 + timedelta(seconds=60))
    assert due.delete == ("d-old",) and not due.pending


def test_a_change_mid_rollout_keeps_the_serving_cluster_and_drops_the_intermediate_one() -> None:
    p = plan([ClusterState("d-old", True), ClusterState("d-mid", False), ClusterState("d-new", False)], "d-old")
    assert (p.serving, p.pending, p.retire) == ("d-old", "d-new", ("d-mid",))
    back = plan([ClusterState("d-old", True), ClusterState("d-new", False)], "d-old", desired="d-old")
    assert (back.serving, back.pending, back.retire) == ("d-old", None, ("d-new",))
    # Reverting to a cluster that was retired (still within its delay, still serving): back to it at once.
    revert = plan([ClusterState("d-old", True, retired_at=T0), ClusterState("d-new", True)], "d-new",
                  desired="d-old", now=T0 + timedelta(seconds=5))
    assert (revert.serving, revert.pending, revert.unretire, revert.retire) == ("d-old", None, ("d-old",),
                                                                               ("d-new",))


def test_suspended_or_zero_replicas_switch_and_delete_at_once_and_a_missing_serving_cluster_is_replaced() -> None:
    p = plan([ClusterState("d-old", True), ClusterState("d-new", False)], "d-old", immediate=True)
    assert (p.serving, p.pending, p.delete) == ("d-new", None, ("d-old",))
    gone = plan([ClusterState("d-new", False)], "d-deleted-by-someone")
    assert gone.serving == "d-new"
    no_delay = plan([ClusterState("d-old", True), ClusterState("d-new", True)], "d-old", delay=0)
    assert (no_delay.serving, no_delay.delete) == ("d-new", ("d-old",))


def test_retired_at_annotation_is_read_back() -> None:
    obj = {"metadata": {"name": "c", "annotations": {"fusedserve.io/retired-at": "2026-12-01T12:00:00Z"}}}
    assert ClusterState.of(obj, True).retired_at == T0
    assert ClusterState.of({"metadata": {"name": "c", "annotations": {"fusedserve.io/retired-at": "x"}}},
                           True).retired_at is None


BODY = yaml.safe_load((REPO / "examples" / "01-tiny-code.yaml").read_text())


def _controller(ready: int) -> dict[str, Any]:
    return {"ready_replicas": ready, "updated_replicas": ready, "creating": [], "last_failure": None,
            "groups": [{"index": 0, "phase": "Ready", "revision": "r", "ranks": []}] if ready else []}


def _status(**kw: Any) -> dict[str, Any]:
    obs = Observation(Owner.of(BODY), 2, T0, parse_spec(BODY), None, 2,
                      RayClusterObservation("ready", 1, 1), **kw)
    return compute_status(obs, None)


def _conds(st: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in st["conditions"]}


def test_status_during_a_rollout_serves_from_the_old_cluster_and_says_how_far_the_new_one_is() -> None:
    st = _status(controller=_controller(1), rollout=RolloutObservation("tiny-code-aaaaa", "tiny-code-bbbbb", 0))
    c = _conds(st)
    assert c["Ready"][:2] == ("True", "EngineGroupsReady")
    assert c["Progressing"][:2] == ("True", "ClusterRollout") and "tiny-code-bbbbb" in c["Progressing"][2]
    assert (st["rayCluster"], st["pendingRayCluster"]) == ("tiny-code-aaaaa", "tiny-code-bbbbb")
    done = _status(controller=_controller(1), rollout=RolloutObservation("tiny-code-bbbbb"))
    assert _conds(done)["Progressing"][:2] == ("False", "RolloutComplete") and "pendingRayCluster" not in done


POD_FAILED = {"metadata": {"name": "tiny-code-bbbbb-head-x"}, "status": {"initContainerStatuses": [{
    "name": "model-download", "restartCount": 3,
    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
    "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                 "message": "hf://org/missing: 401 Unauthorized (is spec.modelStorage."
                                            "huggingFace.tokenSecret set?)"}}}]}}


def test_a_failed_download_is_read_from_the_init_container_and_shown_in_status() -> None:
    failure = DownloadFailure.of([{"metadata": {"name": "ok"}, "status": {}}, POD_FAILED])
    assert failure is not None and failure.restarts == 3 and "401 Unauthorized" in failure.message
    assert DownloadFailure.of([{"metadata": {"name": "p"}, "status": {"initContainerStatuses": [
        {"name": "model-download", "state": {"terminated": {"exitCode": 0}}}]}}]) is None
    st = _status(controller=None, controller_error="connection refused", download_failure=failure)
    c = _conds(st)
    assert c["Ready"][:2] == ("False", "ModelDownloadFailed") and "401 Unauthorized" in c["Ready"][2]
    assert c["Degraded"][:2] == ("True", "ModelDownloadFailed") and "backoff" in c["Degraded"][2]
    serving = _status(controller=_controller(1), download_failure=failure)  # the old cluster still serves
    assert _conds(serving)["Ready"][0] == "True" and _conds(serving)["Degraded"][1] == "ModelDownloadFailed"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        mode = self.path.strip("/")
        self.server.seen_auth = self.headers.get("Authorization")  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if mode == "huge":
            self.wfile.write(b'{"x": "' + b"a" * (3 << 20) + b'"}')
        elif mode == "slow":
            for _ in range(40):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"{}")
        else:
            self.wfile.write(b'{"ready_replicas": 1}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def status_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_the_status_read_is_bounded_in_size_and_time_and_sends_the_api_key(
        status_server: http.server.ThreadingHTTPServer) -> None:
    base = f"http://127.0.0.1:{status_server.server_address[1]}"
    assert fetch_status(f"{base}/ok", api_key="k3y") == {"ready_replicas": 1}
    assert status_server.seen_auth == "Bearer k3y"  # type: ignore[attr-defined]
    with pytest.raises(ControllerUnreachable, match="larger than"):
        fetch_status(f"{base}/huge", max_bytes=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(ControllerUnreachable, match="within"):
        fetch_status(f"{base}/slow", timeout=1.0)
    assert time.monotonic() - t0 < 2.5
