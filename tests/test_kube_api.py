"""The emulated Kubernetes API server (tests/kube) against the real kubectl and a real kopf operator.

Each test gets a fresh server (the ``kube_api`` fixture); kubectl talks to it through its own kubeconfig.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `tests.kube` importable under a bare `pytest` too
    sys.path.append(str(REPO_ROOT))

from tests.eventually import eventually
from tests.kube import fixtures
from tests.kube.api_server import KubeAPI, KubeAPIError, object_path

kube_api = fixtures.kube_api  # the fixture, by name

INFD = ("fusedserve.io", "v1alpha1", "inferencedeployments")
EXAMPLES = ("examples/01-tiny-code.yaml", "examples/02-tiny-code-tp2.yaml", "examples/03-tiny-moe-dp-ep.yaml")


def infd(name: str | None = None, subresource: str | None = None) -> str:
    return object_path(*INFD, "default", name, subresource)


def apply_examples(api: KubeAPI) -> None:
    api.kubectl("apply", "-f", "crds/", cwd=REPO_ROOT)
    args = [arg for path in EXAMPLES for arg in ("-f", path)]
    api.kubectl("apply", *args, cwd=REPO_ROOT)


def table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as rows of {HEADER: cell}, cells cut at the header columns."""
    lines = [line for line in text.splitlines() if line.strip()]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", lines[0])]  # headers may hold one space
    bounds = list(zip(starts, starts[1:] + [None]))
    return [{lines[0][a:b].strip(): line[a:b].strip() for a, b in bounds} for line in lines[1:]]




def test_apply_examples_and_print_columns(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)

    out = kube_api.kubectl("get", "infd").stdout
    assert out.split("\n")[0].split() == ["NAME", "READY", "REPLICAS", "TP", "DP", "EP", "ACCEPT", "AGE"]
    rows = {row["NAME"]: row for row in table(out)}
    assert set(rows) == {"tiny-code", "tiny-code-tp2", "tiny-moe"}
    assert (rows["tiny-code"]["TP"], rows["tiny-code"]["DP"]) == ("1", "1")  # schema defaults applied
    assert (rows["tiny-moe"]["TP"], rows["tiny-moe"]["DP"], rows["tiny-moe"]["EP"]) == ("2", "2", "2")
    assert re.fullmatch(r"\d+s", rows["tiny-code"]["AGE"])

    listed = json.loads(kube_api.kubectl("get", "infd", "-o", "json").stdout)
    assert [item["metadata"]["name"] for item in listed["items"]] == ["tiny-code", "tiny-code-tp2", "tiny-moe"]
    meta = listed["items"][0]["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["namespace"] == "default"

    # Short name, category, discovery and the CRD's own status.
    assert "tiny-moe" in kube_api.kubectl("get", "fusedserve").stdout
    resources = kube_api.kubectl("api-resources", "--api-group=fusedserve.io").stdout
    assert re.search(r"inferencedeployments\s+infd\s+fusedserve.io/v1alpha1\s+true\s+InferenceDeployment", resources)
    subresources = {r["name"] for r in kube_api.get("/apis/fusedserve.io/v1alpha1")["resources"]}
    assert {"inferencedeployments/status", "inferencedeployments/scale"} <= subresources
    established = kube_api.kubectl("get", "crd", "inferencedeployments.fusedserve.io", "-o",
                                   'jsonpath={.status.conditions[?(@.type=="Established")].status}').stdout
    assert established == "True"


def test_label_and_field_selectors(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)
    kube_api.kubectl("label", "infd", "tiny-code", "team=a")
    kube_api.kubectl("label", "infd", "tiny-moe", "team=b")

    def names(*args: str) -> list[str]:
        return kube_api.kubectl("get", "infd", "-o", "name", *args).stdout.split()

    prefix = "inferencedeployment.fusedserve.io/"
    assert names("-l", "team=a") == [prefix + "tiny-code"]
    assert names("-l", "team in (a,b)") == [prefix + "tiny-code", prefix + "tiny-moe"]
    assert names("-l", "team!=a") == [prefix + "tiny-code-tp2", prefix + "tiny-moe"]
    assert names("-l", "!team") == [prefix + "tiny-code-tp2"]
    assert names("--field-selector", "metadata.name=tiny-moe") == [prefix + "tiny-moe"]
    assert len(kube_api.list_objects(*INFD, "default", label_selector="team")) == 2

    # A watch with a selector sees an object enter (ADDED) and leave (DELETED) the selection.
    version = kube_api.get(infd())["metadata"]["resourceVersion"]
    kube_api.kubectl("label", "infd", "tiny-code-tp2", "team=a")
    kube_api.kubectl("label", "infd", "tiny-code", "team-")
    events = kube_api.watch_events(infd(), resource_version=version, params={"labelSelector": "team=a"})
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "tiny-code-tp2"), ("DELETED", "tiny-code")]


def test_status_subresource_and_generation(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)
    status = {"status": {"readyReplicas": 1, "conditions": [{"type": "Ready", "status": "True"}],
                         "speculative": {"acceptanceLength": 2.5}}}
    kube_api.kubectl("patch", "infd", "tiny-code", "--subresource=status", "--type=merge", "-p", json.dumps(status))
    obj = kube_api.get(infd("tiny-code"))
    assert obj["status"]["readyReplicas"] == 1 and obj["metadata"]["generation"] == 1
    row = {r["NAME"]: r for r in table(kube_api.kubectl("get", "infd").stdout)}["tiny-code"]
    assert (row["READY"], row["REPLICAS"], row["ACCEPT"]) == ("True", "1", "2.5")

    # The main resource ignores .status; the status subresource ignores everything else.
    kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge", "-p", '{"status": {"readyReplicas": 7}}')
    kube_api.kubectl("patch", "infd", "tiny-code", "--subresource=status", "--type=merge",
                     "-p", '{"spec": {"replicas": 5}}')
    after = kube_api.get(infd("tiny-code"))
    assert after["status"]["readyReplicas"] == 1 and after["spec"]["replicas"] == 1
    assert after["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]  # both were no-ops

    kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge", "-p", '{"spec": {"replicas": 3}}')
    assert kube_api.get(infd("tiny-code"))["metadata"]["generation"] == 2
    kube_api.kubectl("patch", "infd", "tiny-code", "--type=json",
                     "-p", '[{"op": "replace", "path": "/spec/serving/port", "value": 9000}]')
    kube_api.kubectl("annotate", "infd", "tiny-code", "note=metadata-only")
    final = kube_api.get(infd("tiny-code"))
    assert final["spec"]["serving"]["port"] == 9000 and final["metadata"]["generation"] == 3


def test_scale_subresource(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)
    assert "scaled" in kube_api.kubectl("scale", "infd/tiny-code", "--replicas=2").stdout
    assert kube_api.kubectl("get", "infd", "tiny-code", "-o", "jsonpath={.spec.replicas}").stdout == "2"
    assert kube_api.get(infd("tiny-code"))["metadata"]["generation"] == 2

    kube_api.patch(infd("tiny-code", "status"), {"status": {"replicas": 2, "selector": "app=tiny-code"}})
    scale = kube_api.get(infd("tiny-code", "scale"))
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 2} and scale["status"] == {"replicas": 2, "selector": "app=tiny-code"}

    stale = dict(scale, metadata=dict(scale["metadata"], resourceVersion="1"), spec={"replicas": 3})
    with pytest.raises(KubeAPIError) as err:
        kube_api.request("PUT", infd("tiny-code", "scale"), stale)
    assert err.value.status == 409 and err.value.body["reason"] == "Conflict"
    fresh = dict(scale, spec={"replicas": 3})
    assert kube_api.request("PUT", infd("tiny-code", "scale"), fresh)["spec"]["replicas"] == 3


def test_wait_for_a_status_set_concurrently(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)

    def set_status() -> None:
        time.sleep(0.5)
        kube_api.patch(infd("tiny-code", "status"),
                       {"status": {"phase": "Serving", "conditions": [{"type": "Ready", "status": "True"}]}})

    writer = threading.Thread(target=set_status)
    writer.start()
    try:
        out = kube_api.kubectl("wait", "infd/tiny-code", "--for=jsonpath={.status.phase}=Serving", "--timeout=20s")
        assert "condition met" in out.stdout
        out = kube_api.kubectl("wait", "infd/tiny-code", "--for=condition=Ready", "--timeout=20s")
        assert "condition met" in out.stdout
    finally:
        writer.join(10)


def test_get_watch_streams_events(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)
    proc = kube_api.kubectl_popen("get", "infd", "tiny-code", "-w")
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def next_line(timeout: float = 15.0) -> str:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("kubectl get -w printed nothing") from None

    try:
        assert next_line().split()[:2] == ["NAME", "READY"]
        assert next_line().split()[0] == "tiny-code"
        # kubectl watches only after printing (resourceVersion 0, its first event dropped): a write before the
        # watch is open would never be printed, by a real API server either
        kube_api.wait_for_watch("inferencedeployments")
        kube_api.patch(infd("tiny-code", "status"),
                       {"status": {"readyReplicas": 1, "conditions": [{"type": "Ready", "status": "True"}]}})
        assert next_line().split()[:3] == ["tiny-code", "True", "1"]
    finally:
        proc.kill()
        proc.wait(10)


def test_delete_waits_for_finalizers(kube_api: KubeAPI) -> None:
    apply_examples(kube_api)
    kube_api.kubectl("patch", "infd", "tiny-code", "--type=merge",
                     "-p", '{"metadata": {"finalizers": ["test.fusedserve.io/hold"]}}')
    version = kube_api.get(infd("tiny-code"))["metadata"]["resourceVersion"]

    assert "deleted" in kube_api.kubectl("delete", "infd", "tiny-code", "--wait=false").stdout
    held = kube_api.get(infd("tiny-code"))
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["finalizers"] == ["test.fusedserve.io/hold"]
    kube_api.kubectl("delete", "infd", "tiny-code", "--wait=false")  # again: nothing changes

    kube_api.kubectl("patch", "infd", "tiny-code", "--type=json",
                     "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')
    gone = kube_api.kubectl("get", "infd", "tiny-code", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    events = kube_api.watch_events(infd(), resource_version=version)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "tiny-code"), ("DELETED", "tiny-code")]

    # Without finalizers, the object goes at once (and kubectl's own wait for it ends).
    kube_api.kubectl("delete", "infd", "tiny-moe", "--timeout=20s")
    assert [o["metadata"]["name"] for o in kube_api.list_objects(*INFD, "default")] == ["tiny-code-tp2"]


def test_replace_conflicts_and_errors(kube_api: KubeAPI, tmp_path: Path) -> None:
    apply_examples(kube_api)
    obj = json.loads(kube_api.kubectl("get", "infd", "tiny-code", "-o", "json").stdout)
    obj["spec"]["replicas"] = 4
    (tmp_path / "infd.json").write_text(json.dumps(obj))
    kube_api.kubectl("replace", "-f", str(tmp_path / "infd.json"))
    replaced = kube_api.get(infd("tiny-code"))
    assert replaced["spec"]["replicas"] == 4 and replaced["metadata"]["generation"] == 2
    stale = kube_api.kubectl("replace", "-f", str(tmp_path / "infd.json"), check=False)
    assert stale.returncode != 0 and "the object has been modified" in stale.stderr

    with pytest.raises(KubeAPIError) as err:
        kube_api.get(infd("missing"))
    assert err.value.status == 404
    assert err.value.body == {**err.value.body, "kind": "Status", "reason": "NotFound", "code": 404,
                              "details": {"name": "missing", "group": "fusedserve.io",
                                          "kind": "inferencedeployments"}}
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "1"}}
    created = kube_api.create(object_path("", "v1", "configmaps", "ns1"), body)
    assert created["metadata"]["namespace"] == "ns1"  # from the URL
    with pytest.raises(KubeAPIError) as err:
        kube_api.create(object_path("", "v1", "configmaps", "ns1"), body)
    assert (err.value.status, err.value.body["reason"]) == (409, "AlreadyExists")
    cm = object_path("", "v1", "configmaps", "ns1", "cm")
    with pytest.raises(KubeAPIError) as err:
        kube_api.patch(cm, {"metadata": {"resourceVersion": "1"}, "data": {"a": "2"}})
    assert (err.value.status, err.value.body["reason"]) == (409, "Conflict")
    with pytest.raises(KubeAPIError) as err:  # a failed JSON-patch test is 422 (kopf relies on it)
        kube_api.patch(cm, [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}],
                       "application/json-patch+json")
    assert err.value.status == 422
    assert kube_api.get(cm)["data"] == {"a": "1"}


def test_builtin_kinds_events_and_more_crds(kube_api: KubeAPI, tmp_path: Path) -> None:
    kube_api.kubectl("apply", "-f", str(fixtures.CRDS_DIR))
    ray = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "rc"},
           "spec": {"workerGroupSpecs": [{"replicas": 2}]}, "status": {"state": "ignored-on-create"}}
    created = kube_api.create(object_path("ray.io", "v1", "rayclusters", "default"), ray)
    assert "status" not in created
    kube_api.patch(object_path("ray.io", "v1", "rayclusters", "default", "rc", "status"),
                   {"status": {"state": "ready", "desiredWorkerReplicas": 2, "availableWorkerReplicas": 2}})
    row = table(kube_api.kubectl("get", "rayclusters").stdout)[0]
    assert (row["NAME"], row["DESIRED WORKERS"], row["STATUS"]) == ("rc", "2", "ready")

    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "pm"},
               "spec": {"selector": {"matchLabels": {"app": "x"}}, "podMetricsEndpoints": [{"port": "metrics"}]}}
    kube_api.kubectl("apply", "-f", "-", input=json.dumps(monitor))
    assert kube_api.kubectl("get", "pmon", "-o", "name").stdout.strip() == "podmonitor.monitoring.coreos.com/pm"

    # Built-ins: client-side apply re-applies ConfigMaps and Services with strategic-merge patches.
    service: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"},
               "spec": {"ports": [{"name": "http", "port": 80}, {"name": "metrics", "port": 9090}]}}
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "1"}}
    for doc in (service, cm):
        kube_api.kubectl("apply", "-f", "-", input=json.dumps(doc))
    service["spec"]["ports"][0]["port"] = 8080
    cm["data"] = {"a": "2", "b": "3"}
    for doc in (service, cm):
        kube_api.kubectl("apply", "-f", "-", input=json.dumps(doc))
    assert kube_api.get(object_path("", "v1", "configmaps", "default", "cm"))["data"] == {"a": "2", "b": "3"}
    ports = kube_api.get(object_path("", "v1", "services", "default", "svc"))["spec"]["ports"]
    assert ports == [{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}]
    assert kube_api.kubectl("get", "cm,svc", "-o", "name").stdout.split() == ["configmap/cm", "service/svc"]
    assert [r["NAME"] for r in table(kube_api.kubectl("get", "svc").stdout)] == ["svc"]

    event = {"metadata": {"generateName": "rc-"}, "type": "Normal", "reason": "Scheduled", "message": "hello",
             "involvedObject": {"kind": "RayCluster", "name": "rc", "namespace": "default"},
             "lastTimestamp": "2020-01-01T00:00:00Z"}
    posted = kube_api.create(object_path("", "v1", "events", "default"), event)
    assert posted["metadata"]["name"].startswith("rc-") and len(posted["metadata"]["name"]) == 8
    row = table(kube_api.kubectl("get", "events").stdout)[0]
    assert (row["TYPE"], row["REASON"], row["OBJECT"], row["MESSAGE"]) == ("Normal", "Scheduled", "rc", "hello")
    assert re.fullmatch(r"\d+y(\d+d)?", row["LAST SEEN"])  # an age, in years

    kube_api.kubectl("delete", "crd", "rayclusters.ray.io")
    missing = kube_api.kubectl("get", "rayclusters", check=False)
    assert missing.returncode != 0


OPERATOR = '''
import kopf


@kopf.on.login()
def login(**kwargs):
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 20
    settings.networking.request_timeout = 10


@kopf.on.create("fusedserve.io", "v1alpha1", "inferencedeployments")
def adopt(body, spec, patch, **_):
    patch.status["phase"] = "Adopted"
    patch.status["observedReplicas"] = spec.get("replicas")
    kopf.info(body, reason="Adopted", message="adopted by the test operator")


@kopf.on.delete("fusedserve.io", "v1alpha1", "inferencedeployments")
def release(name, logger, **_):
    logger.info(f"released {name}")
'''


def test_kopf_operator_against_the_emulator(kube_api: KubeAPI, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf
    from kopf.testing import KopfRunner

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig_path))
    monkeypatch.setattr(sys, "path", list(sys.path))  # `kopf run <path>` prepends the file's folder
    previous_registry = kopf.get_default_registry()  # `registry=` replaces the process-wide default
    kube_api.kubectl("apply", "-f", "crds/", cwd=REPO_ROOT)
    operator = tmp_path / "kube_api_test_operator.py"
    operator.write_text(OPERATOR)

    try:
        with KopfRunner(["run", "-A", "--standalone", str(operator)], registry=kopf.OperatorRegistry(),
                        timeout=30) as runner:
            kube_api.kubectl("apply", "-f", EXAMPLES[0], cwd=REPO_ROOT)
            eventually(lambda: kube_api.get(infd("tiny-code")).get("status", {}).get("phase") == "Adopted")
            obj = kube_api.get(infd("tiny-code"))
            assert obj["status"]["observedReplicas"] == 1 and obj["metadata"]["finalizers"]
            event = eventually(lambda: kube_api.list_objects("", "v1", "events", "default"))[0]
            assert (event["reason"], event["involvedObject"]["name"]) == ("Adopted", "tiny-code")
            assert "Adopted" in kube_api.kubectl("get", "events").stdout
            kube_api.kubectl("delete", "infd", "tiny-code", "--timeout=20s")  # returns once kopf released it
            assert kube_api.list_objects(*INFD, "default") == []
    finally:
        kopf.set_default_registry(previous_registry)

    assert runner.exception is None and runner.exit_code == 0, runner.output
    assert "released tiny-code" in runner.output


def test_server_binds_loopback_and_stops(tmp_path: Path) -> None:
    with KubeAPI(tmp_path) as api:
        assert api.url.startswith("http://127.0.0.1:")
        watcher = subprocess.Popen(api.kubectl_args("get", "cm", "-w"), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        time.sleep(0.3)
    try:
        assert watcher.wait(10) is not None  # the server ended the open watch on stop
    finally:
        watcher.kill()
    assert api.internal_errors == []


def test_jsonpath_ages_selectors_and_strategic_merge() -> None:
    from tests.kube import jsonpath, objects, printing, selectors

    obj = {"status": {"conditions": [{"type": "Progressing", "status": "False"}, {"type": "Ready", "status": "True"}]}}
    assert jsonpath.find(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath.find(obj, "{.status.conditions[*].type}") == ["Progressing", "Ready"]
    assert jsonpath.first(obj, ".status.conditions[-1].type") == "Ready"
    ages = [printing.human_duration(s) for s in (5, 150, 3 * 3600 + 60, 50 * 3600, 400 * 86400)]
    assert ages == ["5s", "2m30s", "3h1m", "2d2h", "400d"]

    selector = selectors.Selector.parse("app in (a,b),!legacy,tier!=db", "metadata.name=x")
    assert selector.matches({"metadata": {"name": "x", "labels": {"app": "a"}}})
    assert not selector.matches({"metadata": {"name": "x", "labels": {"app": "a", "legacy": "1"}}})

    current = {"spec": {"ports": [{"name": "a", "port": 1, "protocol": "TCP"}, {"name": "b", "port": 2}], "n": 1}}
    patch = {"spec": {"$setElementOrder/ports": [{"name": "c"}, {"name": "a"}],
                      "ports": [{"name": "a", "port": 9}, {"name": "c", "port": 3}, {"name": "b", "$patch": "delete"}]}}
    merged = objects.apply_patch(current, patch, objects.STRATEGIC_PATCH)
    assert merged == {"spec": {"ports": [{"name": "c", "port": 3}, {"name": "a", "port": 9, "protocol": "TCP"}], "n": 1}}
