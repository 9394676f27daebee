"""The operator on the emulated cluster, without Ray: rollouts that need new pods, model sources, server-side
apply, two operator replicas. ``tests/kube/cluster_player.py`` plays KubeRay, the heads' group controllers and
kube-proxy (a client loop goes through the Service to whichever head it selects)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typing_extensions import Self

from tests.eventually import eventually
from tests.kube.api_server import KubeAPI, object_path
from tests.kube.cluster_player import ClusterPlayer
from tests.serve_process import free_port
from tests.test_operator_e2e import (
    CHILDREN,
    INFD,
    REPO,
    InProcessOperator,
    child,
    conditions,
    events,
    infd,
    kube_api,  # noqa: F401  (fixture)
    operator_env,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.e2e
EXAMPLE = yaml.safe_load((REPO / "examples" / "01-tiny-code.yaml").read_text())


@pytest.fixture
def player(kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch) -> Iterator[ClusterPlayer]:  # noqa: F811
    with ClusterPlayer(kube_api) as p:
        monkeypatch.setenv("FUSEDSERVE_OPERATOR_STATUS_URL_TEMPLATE", p.status_url_template)
        yield p


def apply(api: KubeAPI, tmp_path: Path, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    doc["spec"].update(spec)
    path = tmp_path / f"infd-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    api.kubectl("apply", "-f", str(path))
    return doc


def clusters(api: KubeAPI) -> list[str]:
    return sorted(c["metadata"]["name"] for c in api.list_objects(*CHILDREN["RayCluster"], "default"))


def ready(api: KubeAPI) -> dict[str, Any]:
    obj = infd(api, "tiny-code")
    return obj if conditions(obj).get("Ready", ("",))[0] == "True" else {}


class ClientLoop:
    """Completions through the Service, one every ``interval`` s, until stopped (at most ``limit`` requests)."""

    def __init__(self, url: str, interval: float = 0.02, limit: int = 3000) -> None:
        self.url, self.interval, self.limit = url, interval, limit
        self.results: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set() and len(self.results) < self.limit:
                try:
                    r = client.post(f"{self.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
                    self.results.append((r.status_code, r.json().get("served_by", "")))
                except httpx.HTTPError as e:
                    self.results.append((0, repr(e)))
                time.sleep(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def failures(self) -> list[tuple[int, str]]:
        return [r for r in self.results if r[0] != 200]


def test_an_image_change_rolls_to_a_new_ray_cluster_with_the_api_answering_throughout(
        kube_api: KubeAPI, operator_env: dict[str, str], player: ClusterPlayer, tmp_path: Path) -> None:  # noqa: F811
    apply(kube_api, tmp_path, rollout={"clusterDeletionDelaySeconds": 1})
    with InProcessOperator():
        eventually(lambda: ready(kube_api))
        [old] = clusters(kube_api)
        with ClientLoop(player.service_url("tiny-code")) as loop:
            eventually(lambda: len(loop.results) >= 20)
            kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                             "-p", '{"spec": {"image": "ghcr.io/fusedserve/worker:0.2.0"}}')
            new = eventually(lambda: (c := [c for c in clusters(kube_api) if c != old]) and c[0])
            eventually(lambda: player.service_target("tiny-code") == new)
            eventually(lambda: clusters(kube_api) == [new])
            n = len(loop.results)
            eventually(lambda: len(loop.results) >= n + 20)
        st = eventually(lambda: (o := infd(kube_api, "tiny-code"))["status"].get("rayCluster") == new and
                        conditions(o)["Progressing"][0] == "False" and o)
    assert loop.failures == [] and len(loop.results) >= 40
    assert {who for _, who in loop.results} == {old, new}  # served by the old cluster, then by the new one
    assert player.max_clusters == 2  # never more than the serving cluster and the new one
    assert conditions(st)["Ready"][0] == "True" and "pendingRayCluster" not in st["status"]
    head = child(kube_api, "RayCluster", new)["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "ghcr.io/fusedserve/worker:0.2.0"
    names = [c["metadata"]["name"] for c in kube_api.list_objects(*CHILDREN["ConfigMap"], "default")]
    assert names == [f"{new}-engine-config"]  # the old cluster's engine config went with it
    assert ("Normal", "RolloutSwitched") in events(kube_api, "tiny-code")


def test_a_model_from_a_pvc_is_mounted_read_only_and_the_runtime_reads_its_path(
        kube_api: KubeAPI, operator_env: dict[str, str], player: ClusterPlayer, tmp_path: Path) -> None:  # noqa: F811
    apply(kube_api, tmp_path, model={"uri": "pvc://models/tiny/code", "dtype": "float32"})
    with InProcessOperator():
        eventually(lambda: ready(kube_api))
    [name] = clusters(kube_api)
    rc = child(kube_api, "RayCluster", name)
    for group in (rc["spec"]["headGroupSpec"], rc["spec"]["workerGroupSpecs"][0]):
        pod = group["template"]["spec"]
        assert {"name": "model-pvc-0", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in \
            pod["volumes"]
        assert {"name": "model-pvc-0", "mountPath": "/models/pvc/models", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"]
        assert "initContainers" not in pod  # nothing to download
    manifest = yaml.safe_load(child(kube_api, "ConfigMap", f"{name}-engine-config")["data"]["deployment.yaml"])
    assert manifest["spec"]["model"]["path"] == "/models/pvc/models/tiny/code"


def test_a_failed_model_download_shows_in_status_and_an_event_until_it_succeeds(
        kube_api: KubeAPI, operator_env: dict[str, str], player: ClusterPlayer, tmp_path: Path) -> None:  # noqa: F811
    apply(kube_api, tmp_path, model={"uri": "hf://org/missing", "dtype": "float32"})
    with InProcessOperator():
        [name] = eventually(lambda: clusters(kube_api))
        message = "hf://org/missing: RepositoryNotFoundError: 401 Client Error (is spec.modelStorage.huggingFace." \
                  "tokenSecret set and allowed to read it?)"
        player.fail_download(name, "tiny-code", message, restarts=3)
        failed = eventually(lambda: conditions(o := infd(kube_api, "tiny-code")).get("Ready", ("", ""))[1] ==
                            "ModelDownloadFailed" and o)
        text = {c["type"]: c["message"] for c in failed["status"]["conditions"]}
        assert "401 Client Error" in text["Ready"] and "3 restart(s)" in text["Ready"]
        assert conditions(failed)["Degraded"] == ("True", "ModelDownloadFailed")
        assert ("Warning", "ModelDownloadFailed") in eventually(lambda: events(kube_api, "tiny-code"))
        kube_api.delete(object_path("", "v1", "pods", "default", f"{name}-head-abcde"))  # retried, succeeded
        player.release(name)
        eventually(lambda: ready(kube_api))
        rc = child(kube_api, "RayCluster", name)
    init = rc["spec"]["headGroupSpec"]["template"]["spec"]["initContainers"][0]
    assert init["name"] == "model-download" and "--no-weights" in init["args"]


def test_server_side_apply_removes_what_the_spec_dropped_and_keeps_what_others_own(
        kube_api: KubeAPI, operator_env: dict[str, str], player: ClusterPlayer, tmp_path: Path) -> None:  # noqa: F811
    apply(kube_api, tmp_path, service={"annotations": {"example.com/a": "1", "example.com/b": "2"}})
    with InProcessOperator():
        eventually(lambda: ready(kube_api))
        [name] = clusters(kube_api)
        kube_api.kubectl("annotate", "svc", "tiny-code", "example.com/by-user=kept")
        kube_api.request("PATCH", object_path(*CHILDREN["RayCluster"], "default", name),
                         {"metadata": {"annotations": {"ray.io/ft-enabled": "false"}}},
                         content_type="application/merge-patch+json", params={"fieldManager": "kuberay-operator"})
        kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                         "-p", '{"spec": {"service": {"annotations": {"example.com/b": null}}}}')
        svc = eventually(lambda: (s := child(kube_api, "Service", "tiny-code"))["metadata"]["annotations"].get(
            "example.com/b") is None and s)
    assert svc["metadata"]["annotations"] == {"example.com/a": "1", "example.com/by-user": "kept"}
    managers = {(e["manager"], e["operation"]) for e in svc["metadata"]["managedFields"]}
    assert ("fusedserve-operator", "Apply") in managers
    rc = child(kube_api, "RayCluster", name)
    assert rc["metadata"]["annotations"]["ray.io/ft-enabled"] == "false"  # KubeRay's field, left alone
    assert clusters(kube_api) == [name]  # a Service change needs no new pods


def _operator(env: dict[str, str], identity: str, log: Path, template: str, lifetime: int = 3) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "fusedserve.operator.main", "--all-namespaces", "--listen-address", "127.0.0.1",
            "--health-port", str(free_port()), "--status-interval", "1", "--peering-lifetime", str(lifetime),
            "--status-url-template", template]
    out = open(log, "a")  # noqa: SIM115 (closed with the process)
    child_env = {**os.environ, **env, "POD_ID": identity, "FUSEDSERVE_OPERATOR_METRICS_PORT": ""}
    return subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True, env=child_env)


def _active(api: KubeAPI) -> str | None:
    peering = api.get(object_path("kopf.dev", "v1", "clusterkopfpeerings", None, "fusedserve"))
    peers = {k: v for k, v in (peering.get("status") or {}).items() if isinstance(v, dict) and v.get("lifetime")}
    return max(peers, key=lambda k: peers[k]["priority"]) if len(peers) == 2 else None


def test_two_operator_replicas_one_killed_mid_rollout_leave_no_duplicates_and_finish_the_rollout(
        kube_api: KubeAPI, operator_env: dict[str, str], player: ClusterPlayer, tmp_path: Path) -> None:  # noqa: F811
    log = tmp_path / "operators.log"
    procs = {name: _operator(operator_env, name, log, player.status_url_template) for name in ("op-a", "op-b")}
    try:
        apply(kube_api, tmp_path, rollout={"clusterDeletionDelaySeconds": 1})
        eventually(lambda: ready(kube_api), timeout=60)
        active = eventually(lambda: _active(kube_api))
        [old] = clusters(kube_api)
        kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                         "-p", '{"spec": {"image": "ghcr.io/fusedserve/worker:0.2.0"}}')
        procs[active].send_signal(signal.SIGKILL)  # mid-rollout, no cleanup, its peering entry left behind
        procs[active].wait(10)
        new = eventually(lambda: (c := [c for c in clusters(kube_api) if c != old]) and c[0], timeout=60)
        eventually(lambda: clusters(kube_api) == [new], timeout=60)
        st = eventually(lambda: (o := infd(kube_api, "tiny-code"))["status"].get("rayCluster") == new and
                        o["status"].get("observedGeneration") == 2 and ready(kube_api) and o, timeout=30)
        assert player.max_clusters == 2
        for kind, plural in CHILDREN.items():
            assert len(kube_api.list_objects(*plural, "default")) == 1, kind
        assert len(kube_api.list_objects("", "v1", "secrets", "default")) == 1  # one Ray token, never rewritten
        assert conditions(st)["Ready"][0] == "True"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    text = log.read_text()
    assert "Traceback" not in text, text
    assert kube_api.list_objects(*INFD, "default")
