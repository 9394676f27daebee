"""The operator end to end on the emulated cluster: kubectl, the real kopf operator, a real group controller.

No control plane exists here (TESTING.md): ``tests/kube`` emulates the API server; the tests play
KubeRay (marking the RayCluster ready) and the kubelet (projecting the engine ConfigMap into the
file the group controller watches). The operator runs under ``kopf.testing.KopfRunner`` and, for
the restart test, as the ``fusedserve-operator`` command a user (or the chart) starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typing_extensions import Self

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(REPO))
os.environ.setdefault("FUSEDSERVE_OPERATOR_STATUS_INTERVAL", "1")  # read when the handlers are declared

from tests.eventually import eventually
from tests.kube import fixtures
from tests.kube.api_server import KubeAPI, object_path
from tests.serve_process import Server, free_port

pytestmark = pytest.mark.e2e
kube_api = fixtures.kube_api

INFD = ("fusedserve.io", "v1alpha1", "inferencedeployments")
CHILDREN = {"RayCluster": ("ray.io", "v1", "rayclusters"), "ConfigMap": ("", "v1", "configmaps"),
            "Service": ("", "v1", "services"), "PodMonitor": ("monitoring.coreos.com", "v1", "podmonitors"),
            "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
            "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets")}




def infd(api: KubeAPI, name: str) -> dict[str, Any]:
    return api.get(object_path(*INFD, "default", name))  # type: ignore[no-any-return]


def child(api: KubeAPI, kind: str, name: str) -> dict[str, Any]:
    return api.get(object_path(*CHILDREN[kind], "default", name))  # type: ignore[no-any-return]


def cluster_of(api: KubeAPI, deployment: str) -> str:
    """The deployment's one RayCluster (named by its pod revision)."""
    found = api.list_objects(*CHILDREN["RayCluster"], "default", label_selector=f"fusedserve.io/deployment={deployment}")
    assert len(found) == 1, [c["metadata"]["name"] for c in found]
    return str(found[0]["metadata"]["name"])


def config_of(api: KubeAPI, deployment: str) -> str:
    """The engine ConfigMap of the deployment's RayCluster."""
    return f"{cluster_of(api, deployment)}-engine-config"


def conditions(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in (obj.get("status") or {}).get("conditions", [])}


def events(api: KubeAPI, name: str) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in api.list_objects("", "v1", "events", "default")
            if e["involvedObject"]["name"] == name]


def install_crds(api: KubeAPI) -> None:
    api.kubectl("apply", "-f", "crds/", cwd=REPO)
    api.kubectl("apply", "-f", str(fixtures.CRDS_DIR), cwd=REPO)


def play_kuberay(api: KubeAPI, name: str, workers: int = 1) -> None:
    api.patch(object_path(*CHILDREN["RayCluster"], "default", name, "status"),
              {"status": {"state": "ready", "desiredWorkerReplicas": workers, "readyWorkerReplicas": workers}})


def play_kubelet(api: KubeAPI, config_map: str, path: Path) -> str:
    """Project the ConfigMap's manifest into ``path`` (atomically, as the kubelet's symlink swap)."""
    text: str = child(api, "ConfigMap", config_map)["data"]["deployment.yaml"]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return text


@pytest.fixture
def operator_env(kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = {"KUBECONFIG": str(kube_api.kubeconfig_path), "FUSEDSERVE_OPERATOR_LISTEN_ADDRESS": "127.0.0.1",
           "FUSEDSERVE_OPERATOR_RETRY_DELAY": "1", "FUSEDSERVE_OPERATOR_METRICS_PORT": str(free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    install_crds(kube_api)
    yield env


class InProcessOperator:
    """The real handlers under kopf's KopfRunner."""

    def __init__(self) -> None:
        from kopf.testing import KopfRunner

        import fusedserve.operator.handlers  # noqa: F401  (registers into kopf's default registry)

        self.runner = KopfRunner(["run", "-A", "--standalone", "-m", "fusedserve.operator.handlers"], timeout=120)

    def __enter__(self) -> Self:
        self.runner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.__exit__(*exc)
        assert self.runner.exception is None, self.runner.output
        assert "Traceback" not in self.runner.output, self.runner.output


@pytest.mark.ray
def test_deployment_reaches_ready_with_a_real_acceptance_length_scales_and_is_deleted(
        kube_api: KubeAPI, operator_env: dict[str, str], ray_address: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("FUSEDSERVE_OPERATOR_STATUS_URL_TEMPLATE", f"http://127.0.0.1:{port}/status")
    manifest = tmp_path / "deployment.yaml"
    with InProcessOperator():
        kube_api.kubectl("apply", "-f", "examples/01-tiny-code.yaml", cwd=REPO)
        uid = infd(kube_api, "tiny-code")["metadata"]["uid"]
        rc = eventually(lambda: cluster_of(kube_api, "tiny-code"))
        for kind, name in (("RayCluster", rc), ("ConfigMap", f"{rc}-engine-config"),
                           ("Service", "tiny-code"), ("PodMonitor", "tiny-code"), ("NetworkPolicy", "tiny-code"),
                           ("PodDisruptionBudget", "tiny-code")):
            obj = eventually(lambda kind=kind, name=name: child(kube_api, kind, name))
            [ref] = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceDeployment", "tiny-code",
                                                                               uid, True)
        waiting = eventually(lambda: conditions(o := infd(kube_api, "tiny-code")).get("Scheduled") and o)
        assert conditions(waiting)["Scheduled"] == ("False", "WaitingForPods")
        assert conditions(waiting)["Ready"] == ("Unknown", "ControllerUnreachable")
        assert "fusedserve.io/finalizer" in infd(kube_api, "tiny-code")["metadata"]["finalizers"]

        play_kuberay(kube_api, rc)
        play_kubelet(kube_api, f"{rc}-engine-config", manifest)
        server = Server(manifest, ray_address, port=port, extra_args=("--watch",))
        try:
            ready = eventually(lambda: (o := infd(kube_api, "tiny-code"))["status"].get("speculative") and
                               conditions(o)["Ready"][0] == "True" and o, timeout=60)
            st = ready["status"]
            assert conditions(ready) == {"Ready": ("True", "EngineGroupsReady"), "Scheduled": ("True", "PodsReady"),
                                         "Progressing": ("False", "RolloutComplete"),
                                         "Degraded": ("False", "AsExpected")}
            accept = float(st["speculative"]["acceptanceLength"])
            assert 1.0 < accept <= 4.0  # numSteps 3: at most 1 + 3
            assert (st["readyReplicas"], st["replicas"], st["observedGeneration"]) == (1, 1, 1)
            assert st["selector"] == "fusedserve.io/deployment=tiny-code"
            table = kube_api.kubectl("get", "infd").stdout.splitlines()
            assert table[0].split() == ["NAME", "READY", "REPLICAS", "TP", "DP", "EP", "ACCEPT", "AGE"]
            assert table[1].split()[:7] == ["tiny-code", "True", "1", "1", "1", "1", st["speculative"]["acceptanceLength"]]
            assert ("Normal", "Ready") in events(kube_api, "tiny-code")
            assert "Ready" in kube_api.kubectl("get", "events").stdout

            # Scale through the scale subresource. The worker pod needs a third GPU (2 groups + 1 surge group):
            # new pods, so a new RayCluster; the Service stays on the old one until the new one serves.
            kube_api.kubectl("scale", "infd/tiny-code", "--replicas=2")
            new = eventually(lambda: (c := [x["metadata"]["name"] for x in kube_api.list_objects(
                *CHILDREN["RayCluster"], "default") if x["metadata"]["name"] != rc]) and c[0])
            eventually(lambda: "replicas: 2" in child(kube_api, "ConfigMap", f"{new}-engine-config")["data"]
                       ["deployment.yaml"])
            worker_group = child(kube_api, "RayCluster", new)["spec"]["workerGroupSpecs"][0]
            assert worker_group["rayStartParams"]["num-gpus"] == "3"  # 2 groups + 1 surge group of 1 GPU
            play_kuberay(kube_api, new)
            play_kubelet(kube_api, f"{new}-engine-config", manifest)  # one controller plays both heads here
            scaled = eventually(lambda: (o := infd(kube_api, "tiny-code"))["status"].get("readyReplicas") == 2 and o,
                                timeout=90)
            assert scaled["status"]["observedGeneration"] == 2 and conditions(scaled)["Ready"][0] == "True"
            eventually(lambda: infd(kube_api, "tiny-code")["status"].get("rayCluster") == new)
            assert child(kube_api, "Service", "tiny-code")["spec"]["selector"]["ray.io/cluster"] == new
            assert [g["index"] for g in scaled["status"]["groups"]] == [0, 1]
            scale = kube_api.get(object_path(*INFD, "default", "tiny-code", "scale"))
            assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (2, 2)

            metrics = httpx.get(f"http://127.0.0.1:{operator_env['FUSEDSERVE_OPERATOR_METRICS_PORT']}/metrics").text
            values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                      for fam in text_string_to_metric_families(metrics) for s in fam.samples}
            assert values[("fusedserve_operator_reconciles_total", (("result", "success"),))] >= 2
            assert values[("fusedserve_operator_time_to_ready_seconds_count", ())] == 1
            assert values[("fusedserve_operator_deployments", (("condition", "Ready"), ("status", "True")))] == 1

            kube_api.kubectl("delete", "infd", "tiny-code", "--timeout=30s")
            assert kube_api.list_objects(*INFD, "default") == []
            for kind, plural in CHILDREN.items():
                assert kube_api.list_objects(*plural, "default") == [], kind
        finally:
            assert server.stop() == 0, "".join(server.output[-30:])


def test_invalid_and_malformed_objects_are_reported_and_never_stop_the_operator(
        kube_api: KubeAPI, operator_env: dict[str, str], tmp_path: Path) -> None:
    bad = yaml.safe_load((REPO / "examples/02-tiny-code-tp2.yaml").read_text())
    bad["metadata"]["name"] = "bad-parallelism"
    bad["spec"]["parallelism"] = {"tensor": 3, "data": 2, "dataParallelAttention": True}
    malformed = {"apiVersion": "fusedserve.io/v1alpha1", "kind": "InferenceDeployment",
                 "metadata": {"name": "malformed", "namespace": "default"}, "spec": "not a mapping"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([bad, malformed]))
    with InProcessOperator():
        kube_api.kubectl("apply", "-f", str(path))  # the emulator, like a cluster without our CRD's rules
        kube_api.kubectl("apply", "-f", "examples/02-tiny-code-tp2.yaml", cwd=REPO)
        for name, message in (("bad-parallelism", "data=2 must divide tensor=3"),
                              ("malformed", "spec: must be a mapping")):
            obj = eventually(lambda name=name: conditions(o := infd(kube_api, name)).get("Ready") and o)
            assert conditions(obj)["Ready"] == ("False", "InvalidSpec")
            assert message in next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "Ready")
            assert ("Warning", "InvalidSpec") in eventually(lambda name=name: events(kube_api, name))
        assert eventually(lambda: cluster_of(kube_api, "tiny-code-tp2"))  # the valid one still reconciles
        with pytest.raises(AssertionError):
            cluster_of(kube_api, "bad-parallelism")
        fixed = {"spec": {"parallelism": {"tensor": 2, "data": 1, "dataParallelAttention": False}}}
        kube_api.patch(object_path(*INFD, "default", "bad-parallelism"), fixed)
        assert eventually(lambda: cluster_of(kube_api, "bad-parallelism"))  # fixed -> reconciled
        kube_api.kubectl("delete", "infd", "--all", "--timeout=30s")
        assert kube_api.list_objects(*INFD, "default") == []


def test_suspend_restart_token_and_monitoring_toggle(kube_api: KubeAPI, operator_env: dict[str, str]) -> None:
    with InProcessOperator():
        kube_api.kubectl("apply", "-f", "examples/01-tiny-code.yaml", cwd=REPO)
        eventually(lambda: child(kube_api, "PodMonitor", "tiny-code"))
        rc = cluster_of(kube_api, "tiny-code")
        kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge", "-p", '{"spec": {"suspend": true}}')
        eventually(lambda: child(kube_api, "RayCluster", rc)["spec"]["suspend"] is True)
        assert cluster_of(kube_api, "tiny-code") == rc  # suspending keeps the cluster (KubeRay deletes its pods)
        group = child(kube_api, "RayCluster", rc)["spec"]["workerGroupSpecs"][0]
        assert group["replicas"] == 0
        eventually(lambda: conditions(infd(kube_api, "tiny-code"))["Ready"] == ("False", "Suspended"))
        kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                         "-p", '{"spec": {"suspend": false, "restartToken": "again-1"}}')
        eventually(lambda: "fusedserve.io/restart-token: again-1" in
                   child(kube_api, "ConfigMap", f"{rc}-engine-config")["data"]["deployment.yaml"])
        assert child(kube_api, "RayCluster", rc)["spec"]["suspend"] is False
        kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                         "-p", '{"spec": {"monitoring": {"podMonitor": false}}}')
        eventually(lambda: kube_api.list_objects(*CHILDREN["PodMonitor"], "default") == [])
        assert ("Normal", "Reconciled") in events(kube_api, "tiny-code")


def test_an_operator_restart_creates_no_duplicates_and_keeps_status(
        kube_api: KubeAPI, operator_env: dict[str, str], tmp_path: Path) -> None:
    health = free_port()
    args = [sys.executable, "-m", "fusedserve.operator.main", "--all-namespaces", "--standalone",
            "--listen-address", "127.0.0.1", "--health-port", str(health),
            "--metrics-port", operator_env["FUSEDSERVE_OPERATOR_METRICS_PORT"], "--status-interval", "1",
            "--status-url-template", f"http://127.0.0.1:{free_port()}/status"]  # nothing listens: unreachable

    def start() -> subprocess.Popen[str]:
        log = open(tmp_path / "operator.log", "a")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True, env=os.environ)

    proc = start()
    try:
        eventually(lambda: httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2).status_code == 200)
        kube_api.kubectl("apply", "-f", "examples/01-tiny-code.yaml", cwd=REPO)
        play = eventually(lambda: cluster_of(kube_api, "tiny-code"))
        play_kuberay(kube_api, play, workers=1)
        first = eventually(lambda: conditions(o := infd(kube_api, "tiny-code")).get("Scheduled", ("",))[0] == "True"
                           and o)
        proc.send_signal(signal.SIGKILL)  # mid-way: no cleanup
        proc.wait(10)
        kube_api.kubectl("scale", "infd/tiny-code", "--replicas=2")  # a change while nobody watches
        proc = start()
        eventually(lambda: any("replicas: 2" in cm["data"]["deployment.yaml"] for cm in kube_api.list_objects(
            *CHILDREN["ConfigMap"], "default")))
        again = eventually(lambda: (o := infd(kube_api, "tiny-code"))["status"].get("observedGeneration") == 2 and o)
        # A third GPU in the worker pod is a new RayCluster (and its engine config) beside the serving one,
        # which stays until the new one serves (nobody plays its head here): exactly those two, no duplicate.
        for kind, plural in CHILDREN.items():
            assert len(kube_api.list_objects(*plural, "default")) == (2 if kind in ("RayCluster", "ConfigMap")
                                                                       else 1), kind
        since = {c["type"]: c["lastTransitionTime"] for c in first["status"]["conditions"]}
        now = {c["type"]: c["lastTransitionTime"] for c in again["status"]["conditions"]}
        assert now["Scheduled"] == since["Scheduled"] and now["Ready"] == since["Ready"]  # no transition: kept
        kube_api.kubectl("delete", "infd", "tiny-code", "--timeout=30s")
        assert kube_api.list_objects(*CHILDREN["RayCluster"], "default") == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in (tmp_path / "operator.log").read_text(), (tmp_path / "operator.log").read_text()


def test_a_cluster_without_kuberay_is_retried_until_its_crd_appears(kube_api: KubeAPI,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig_path))
    monkeypatch.setenv("FUSEDSERVE_OPERATOR_RETRY_DELAY", "1")
    kube_api.kubectl("apply", "-f", "crds/", cwd=REPO)  # ours only: no RayCluster kind yet
    with InProcessOperator() as op:
        kube_api.kubectl("apply", "-f", "examples/01-tiny-code.yaml", cwd=REPO)
        eventually(lambda: kube_api.list_objects(*CHILDREN["ConfigMap"], "default"))  # made before the RayCluster
        time.sleep(2.0)  # a few retries (1 s apart) fail on the missing kind
        assert kube_api.list_objects(*INFD, "default")  # the object is untouched
        kube_api.kubectl("apply", "-f", str(fixtures.CRDS_DIR / "raycluster.yaml"))
        assert eventually(lambda: cluster_of(kube_api, "tiny-code"))
        assert eventually(lambda: child(kube_api, "Service", "tiny-code"))
    assert "is KubeRay installed?" in op.runner.output  # the temporary error, retried after its delay
