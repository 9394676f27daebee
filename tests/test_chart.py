"""The Helm chart, rendered by the real Helm engine (helm-python-sdk; no helm CLI here, TESTING.md).

Rendered for the default values, the CI values files (charts/fusedserve/ci/) and every toggle; each object is
checked against the Kubernetes schemas of the oldest supported and a current version (kubernetes-validate,
strict: unknown fields fail). ServiceMonitor and PrometheusRule are custom resources with no schema there: they
are checked against the subset of the Prometheus Operator's monitoring.coreos.com/v1 schema the chart uses.
PromQL and metric names of dashboards and alerts: tests/test_dashboards.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from fusedserve.operator.api import InferenceDeploymentSpec
from fusedserve.operator.crd import CRD_FILE, PEERING_FILE
from fusedserve.operator.operator_config import OperatorConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "fusedserve"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "fs", "fusedserve-system"
MONITORING_API = "monitoring.coreos.com/v1"
KUBE_VERSIONS = ("1.27.0", "1.30.0")  # Chart.yaml's kubeVersion floor and a current one
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # not in kubernetes-validate: checked with MONITORING_SCHEMAS
CLUSTER_KINDS = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}

# The operator's permissions (operator/ needs exactly these; scale is for users only: see USER_ROLES).
NAMESPACED_RULES = {
    ("fusedserve.io", "inferencedeployments"): {"get", "list", "watch", "patch"},
    ("fusedserve.io", "inferencedeployments/status"): {"get", "patch"},
    ("ray.io", "rayclusters"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "secrets"): {"get", "list", "create", "delete"},  # the Ray token (created once), the API key (read)
    ("", "pods"): {"get", "list"},  # failed model downloads (init container status)
    ("", "events"): {"create", "patch"},
    ("monitoring.coreos.com", "podmonitors"): {"get", "list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "create", "patch"},
}
CLUSTER_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
    ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "create", "patch"},
}
USER_ROLES = {
    "edit": ({"rbac.authorization.k8s.io/aggregate-to-admin", "rbac.authorization.k8s.io/aggregate-to-edit"}, {
        ("fusedserve.io", "inferencedeployments"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("fusedserve.io", "inferencedeployments/scale"): {"get", "update", "patch"}}),
    "view": ({"rbac.authorization.k8s.io/aggregate-to-view"}, {
        ("fusedserve.io", "inferencedeployments"): {"get", "list", "watch"}}),
}


# --- rendering --------------------------------------------------------------------------------------------------

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as c:
        yield c


def render_files(chart: helm_python.Chart, values: dict[str, Any] | None = None, *, name: str = RELEASE,
                 api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Template path -> rendered text, as `helm template --api-versions ...` would give.

    ``Chart.render`` has no API-versions argument; the library's render call takes ``api_versions`` in its
    options (the same call ``Chart.render`` makes), which test_monitoring_follows_the_api_or_the_value checks
    is honoured."""
    opts: dict[str, Any] = {"name": name, "namespace": NAMESPACE}
    if api_versions:
        opts["api_versions"] = list(api_versions)
    out = _native.call_string("helm_render", chart._raw(), json.dumps(values) if values is not None else None,
                              json.dumps(opts))
    rendered: dict[str, str] = json.loads(out)
    return rendered


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None, *, name: str = RELEASE,
           api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every object the templates render (NOTES.txt excluded)."""
    objects = []
    for path, text in sorted(render_files(chart, values, name=name, api_versions=api_versions).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]
    return objects


def kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [obj] = kinds(objects, kind)
    return obj


def ci_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(path.read_text())
    return values


# Every toggle of values.yaml, each on top of the defaults; rendered with and without the Prometheus Operator API.
TOGGLES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "monitoring-on": {"monitoring": {"enabled": True}},
    "monitoring-off": {"monitoring": {"enabled": False}},
    "no-servicemonitor": {"monitoring": {"enabled": True, "serviceMonitor": {"enabled": False}}},
    "no-prometheusrule": {"monitoring": {"enabled": True, "prometheusRule": {"enabled": False}}},
    "no-alerts": {"monitoring": {"enabled": True}, "alerts": {
        name: {"enabled": False} for name in ("acceptanceLengthLow", "acceptanceLengthDrop", "extraCollectives",
                                             "notReady", "ttftHigh", "reconcileErrors")}},
    "worker-alerts-only": {"monitoring": {"enabled": True},
                           "alerts": {"notReady": {"enabled": False}, "reconcileErrors": {"enabled": False}}},
    "operator-alerts-only": {"monitoring": {"enabled": True}, "alerts": {
        name: {"enabled": False} for name in ("acceptanceLengthLow", "acceptanceLengthDrop", "extraCollectives",
                                             "ttftHigh")}},
    "no-dashboards": {"dashboards": {"enabled": False}},
    "no-rbac": {"rbac": {"create": False}},
    "no-user-roles": {"rbac": {"aggregateToDefaultRoles": False}},
    "existing-serviceaccount": {"serviceAccount": {"create": False, "name": "ops"}},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "crds-off": {"crds": {"install": False}},
    "crds-not-kept": {"crds": {"keep": False}},
    "one-replica": {"replicaCount": 1},
    "no-network-policy": {"networkPolicy": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
    "images": {"global": {"imageRegistry": "mirror.example:5000", "imagePullSecrets": [{"name": "mirror"}],
                          "storageClass": "fast"},
               "image": {"digest": "sha256:" + "a" * 64}, "workerImage": {"tag": "0.1.0-cu130"}},
    "extras": {"commonLabels": {"team": "ml-platform"},
               "operator": {"extraEnv": [{"name": "X", "value": "1"}], "extraArgs": ["--status-interval", "5"],
                            "extraVolumes": [{"name": "ca", "configMap": {"name": "ca-bundle"}}],
                            "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/custom", "readOnly": True}],
                            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                {"weight": 1, "preference": {"matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["system"]}]}}]}},
                            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                           "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {
                                                               "matchLabels": {"app.kubernetes.io/component": "operator"}}}],
                            "readinessProbe": {"httpGet": {"path": "/healthz", "port": "health"}, "periodSeconds": 3},
                            "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 20000, "fsGroup": 20000},
                            "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                                "allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}}},
    "pod-options": {"image": {"tag": "dev"}, "imagePullSecrets": [{"name": "regcred"}],
                    "operator": {"nodeSelector": {"pool": "system"}, "priorityClassName": "high",
                                 "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
                                 "podAnnotations": {"a": "b"}, "podLabels": {"team": "ml"}}},
    **{f"ci-{p.stem}": ci_values(p) for p in CI_VALUES},
}


# --- schemas of the Prometheus Operator kinds (the subset of monitoring.coreos.com/v1 the chart uses) ----------

_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object", "required": ["name", "namespace"], "additionalProperties": False,
             "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                            "labels": _STRING_MAP, "annotations": _STRING_MAP}}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": required or []}


MONITORING_SCHEMAS = {
    "ServiceMonitor": _closed({
        "apiVersion": {"const": MONITORING_API}, "kind": {"const": "ServiceMonitor"}, "metadata": _METADATA,
        "spec": _closed({
            "selector": _closed({"matchLabels": _STRING_MAP}),
            "namespaceSelector": _closed({"any": {"type": "boolean"},
                                          "matchNames": {"type": "array", "items": {"type": "string"}}}),
            "endpoints": {"type": "array", "minItems": 1, "items": _closed({
                "port": {"type": "string"}, "path": {"type": "string"}, "interval": _DURATION,
                "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"}})},
        }, ["selector", "endpoints"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    "PrometheusRule": _closed({
        "apiVersion": {"const": MONITORING_API}, "kind": {"const": "PrometheusRule"}, "metadata": _METADATA,
        "spec": _closed({"groups": {"type": "array", "minItems": 1, "items": _closed({
            "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
            "rules": {"type": "array", "minItems": 1, "items": _closed({
                "alert": {"type": "string"}, "record": {"type": "string"},
                "expr": {"type": "string", "minLength": 1}, "for": _DURATION,
                "labels": _STRING_MAP, "annotations": _STRING_MAP}, ["expr"])},
        }, ["name", "rules"])}}, ["groups"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
}


_VALID: set[str] = set()  # objects already validated (many renderings share most objects)


def validate(obj: dict[str, Any]) -> None:
    key = json.dumps(obj, sort_keys=True)
    if key in _VALID:
        return
    if obj["kind"] in CRD_KINDS:
        jsonschema.Draft7Validator(MONITORING_SCHEMAS[obj["kind"]]).validate(obj)
    else:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    _VALID.add(key)


# --- the chart as a whole ---------------------------------------------------------------------------------------

def test_chart_metadata_matches_the_package_and_the_crd_defaults(chart: helm_python.Chart) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "fusedserve"
    assert meta["appVersion"] == package_version("fusedserve") == "0.1.0"
    assert meta["kubeVersion"].startswith(">=1.27")
    # The worker image: no CRD default (the operator's applies), built from the same version as the operator image.
    assert InferenceDeploymentSpec.model_fields["image"].default is None
    assert OperatorConfig().worker_image == f"ghcr.io/fusedserve/worker:{meta['appVersion']}"
    assert chart.values["image"] == {"registry": "ghcr.io", "repository": "fusedserve/operator", "tag": "",
                                     "digest": "", "pullPolicy": "IfNotPresent"}
    args = _container(render(chart))["args"]
    assert args[args.index("--worker-image") + 1] == OperatorConfig().worker_image


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_lint_has_no_errors_or_warnings(values_file: Path | None) -> None:
    values = ci_values(values_file) if values_file else None
    for version in KUBE_VERSIONS:
        report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{version}", namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
        assert not problems and not report["errors"], report


def test_crds_are_the_generated_ones(chart: helm_python.Chart) -> None:
    """charts/fusedserve/files/crds/ is a copy of crds/ (itself generated from operator/, tests/test_crd.py),
    rendered by templates/crds.yaml (so crds.install / crds.keep apply; Helm's crds/ folder could not)."""
    top = {p.name: p.read_bytes() for p in (ROOT / "crds").iterdir()}
    copy = {p.name: p.read_bytes() for p in (CHART / "files" / "crds").iterdir()}
    assert set(top) == {CRD_FILE, PEERING_FILE}
    assert copy == top, "charts/fusedserve/files/crds/ is stale: cp crds/*.yaml charts/fusedserve/files/crds/"
    assert not (CHART / "crds").exists() and not chart.crds
    generated = [d for p in sorted((ROOT / "crds").iterdir()) for d in yaml.safe_load_all(p.read_text()) if d]
    rendered = kinds(render(chart), "CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in rendered} == {"inferencedeployments.fusedserve.io",
                                                        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    for want in generated:
        [got] = [c for c in rendered if c["metadata"]["name"] == want["metadata"]["name"]]
        assert got["spec"] == want["spec"]
        assert got["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert want["metadata"]["labels"].items() <= got["metadata"]["labels"].items()


def test_crds_install_and_keep_follow_the_values(chart: helm_python.Chart) -> None:
    assert not kinds(render(chart, TOGGLES["crds-off"]), "CustomResourceDefinition")
    for crd in kinds(render(chart, TOGGLES["crds-not-kept"]), "CustomResourceDefinition"):
        assert "annotations" not in crd["metadata"]


def test_crds_are_valid_apiextensions_objects() -> None:
    for path in (CHART / "files" / "crds").iterdir():
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc)


# --- values and their schema ------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, where", [
    ({"imagee": {"tag": "x"}}, "imagee"),
    ({"watchNamespace": ["a"]}, "watchNamespace"),
    ({"operator": {"resource": {}}}, "resource"),
    ({"monitoring": {"serviceMonitors": {"enabled": True}}}, "serviceMonitors"),
    ({"alerts": {"ttftHigh": {"threshold": 1}}}, "threshold"),
    ({"dashboards": {"enable": False}}, "enable"),
    ({"monitoring": {"enabled": "yes"}}, "monitoring/enabled"),
    ({"alerts": {"notReady": {"for": "15 minutes"}}}, "notReady/for"),
    ({"operator": {"nodeSelector": {"pool": 1}}}, "nodeSelector/pool"),
])
def test_values_schema_rejects_misspelt_keys_and_bad_values(chart: helm_python.Chart, values: dict[str, Any],
                                                            where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError):
        render(chart, values)


def test_values_schema_closes_every_object() -> None:
    """Every object of values.schema.json lists its keys (additionalProperties: false) or is a typed map."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], path: str) -> Iterator[str]:
        if node.get("type") == "object":
            extra = node.get("additionalProperties")
            if "properties" in node and extra is not False:
                yield f"{path}: has properties but additionalProperties is not false"
            if "properties" not in node and not isinstance(extra, dict):
                yield f"{path}: a map without a typed additionalProperties"
        for key, sub in node.get("properties", {}).items():
            yield from walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}.*")

    assert list(walk(schema, "values")) == []


def _values_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Key paths of values.yaml, not descending into free maps (resources, nodeSelector, ...)."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        yield path
        sub = schema["properties"][key]
        if isinstance(value, dict) and "properties" in sub:
            yield from _values_paths(value, sub, path + ".")


def test_every_value_is_documented_and_in_the_schema(chart: helm_python.Chart) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = chart.values
    chart.validate_schema(defaults)
    paths = list(_values_paths(defaults, schema))  # KeyError: a value the schema does not know

    def schema_paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for key, sub in node.get("properties", {}).items():
            yield prefix + key
            yield from schema_paths(sub, f"{prefix}{key}.")

    assert sorted(schema_paths(schema)) == sorted(paths), "values.yaml and values.schema.json list different keys"
    # helm-docs convention: a `# --` comment right above a key documents it and everything below it.
    documented: set[str] = set()
    stack: list[tuple[int, str]] = []
    comment = False
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if stripped.startswith("#"):
            continue  # a continuation of the comment above
        match = re.match(r"^( *)([A-Za-z0-9_.-]+):", line)
        if not match:
            comment = False
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([p for _, p in stack] + [match.group(2)])
        stack.append((indent, match.group(2)))
        if comment:
            documented.add(path)
        comment = False
    leaves = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]
    undocumented = [p for p in leaves if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert undocumented == []


# --- every rendering validates ----------------------------------------------------------------------------------

@pytest.mark.parametrize("with_api", [False, True], ids=["no-prometheus-operator", "prometheus-operator"])
@pytest.mark.parametrize("case", list(TOGGLES))
def test_every_toggle_renders_valid_objects(chart: helm_python.Chart, case: str, with_api: bool) -> None:
    objects = render(chart, TOGGLES[case], api_versions=(MONITORING_API,) if with_api else ())
    assert kinds(objects, "Deployment"), case
    seen = set()
    for obj in objects:
        validate(obj)
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, key
        seen.add(key)
        assert (obj["kind"] in CLUSTER_KINDS) == ("namespace" not in meta), key
        assert len(meta["name"]) <= 63 and all(len(v) <= 63 for v in meta["labels"].values()), key
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_monitoring_follows_the_api_or_the_value(chart: helm_python.Chart) -> None:
    def monitoring_kinds(values: dict[str, Any] | None, api: bool) -> set[str]:
        objects = render(chart, values, api_versions=(MONITORING_API,) if api else ())
        return {o["kind"] for o in objects} & CRD_KINDS

    both = {"ServiceMonitor", "PrometheusRule"}
    assert monitoring_kinds(None, api=False) == set()  # auto, no Prometheus Operator
    assert monitoring_kinds(None, api=True) == both  # auto, Prometheus Operator present
    assert monitoring_kinds({"monitoring": {"enabled": True}}, api=False) == both
    assert monitoring_kinds({"monitoring": {"enabled": False}}, api=True) == set()
    assert monitoring_kinds(TOGGLES["no-servicemonitor"], api=True) == {"PrometheusRule"}
    assert monitoring_kinds(TOGGLES["no-prometheusrule"], api=True) == {"ServiceMonitor"}
    assert monitoring_kinds(TOGGLES["no-alerts"], api=True) == {"ServiceMonitor"}
    # The metrics Service is there either way (plain Prometheus can scrape it).
    assert one(render(chart), "Service")["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]


def test_monitoring_objects_select_the_operator_and_carry_the_prometheus_labels(chart: helm_python.Chart) -> None:
    objects = render(chart, ci_values(CHART / "ci" / "monitoring-values.yaml"))
    deployment, service, monitor = one(objects, "Deployment"), one(objects, "Service"), one(objects, "ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                             "scrapeTimeout": "5s"}]
    rule = one(objects, "PrometheusRule")
    for obj in (monitor, rule):
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# --- the operator Deployment --------------------------------------------------------------------------------------

def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_pod_is_hardened(chart: helm_python.Chart) -> None:
    objects = render(chart)
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = _container(objects)
    assert deployment["spec"]["replicas"] == 2  # peered: one works, one stands by
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"] == {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # The only writable path is an emptyDir at /tmp.
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    assert c["livenessProbe"]["httpGet"] == c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["image"] == "ghcr.io/fusedserve/operator:0.1.0"
    assert c["command"] == ["fusedserve-operator"]
    assert c["args"] == ["--all-namespaces", "--metrics-port", "8080", "--health-port", "8081", "--peering-lifetime",
                         "15", "--worker-image", "ghcr.io/fusedserve/worker:0.1.0"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_ID": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}  # peering identity, namespace
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"] == {"minAvailable": 1, "selector": deployment["spec"]["selector"]}
    policy = one(objects, "NetworkPolicy")["spec"]
    assert policy["podSelector"] == deployment["spec"]["selector"] and policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"] == [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}], "ports": [{"protocol": "TCP", "port": "metrics"}]}]
    # The operator's pods carry the labels every InferenceDeployment's NetworkPolicy lets reach the API port.
    from fusedserve.operator.network_policy import OPERATOR_POD_LABELS

    assert OPERATOR_POD_LABELS.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]


def test_operator_args_parse_with_the_operators_own_parser(chart: helm_python.Chart) -> None:
    from fusedserve.operator.main import build_parser

    for values in (None, TOGGLES["namespaced"]):
        args = build_parser().parse_args(_container(render(chart, values))["args"])
        assert (args.metrics_port, args.health_port, args.standalone, args.peering_lifetime) == (8080, 8081, False, 15)
        assert args.namespace == (values["watchNamespaces"] if values else None)
        assert args.all_namespaces is (values is None)


def test_pod_options_reach_the_pod(chart: helm_python.Chart) -> None:
    objects = render(chart, TOGGLES["pod-options"])
    pod = one(objects, "Deployment")["spec"]["template"]
    assert _container(objects)["image"] == "ghcr.io/fusedserve/operator:dev"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["nodeSelector"] == {"pool": "system"} and pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["tolerations"] == [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["metadata"]["annotations"] == {"a": "b"} and pod["metadata"]["labels"]["team"] == "ml"


# --- RBAC -------------------------------------------------------------------------------------------------------

def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in out, f"{resource} granted twice in {role['metadata']['name']}"
                out[(group, resource)] = set(rule["verbs"])
    return out


def _operator_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Role", "ClusterRole")
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(chart: helm_python.Chart) -> None:
    objects = render(chart)
    [role] = _operator_roles(objects)
    assert role["kind"] == "ClusterRole" and not kinds(objects, "Role")
    assert _rules(role) == {**NAMESPACED_RULES, **CLUSTER_RULES}
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = one(objects, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]


def test_namespaced_rbac_is_a_role_per_watched_namespace(chart: helm_python.Chart) -> None:
    objects = render(chart, TOGGLES["namespaced"])
    [cluster_role] = [r for r in _operator_roles(objects) if r["kind"] == "ClusterRole"]
    assert _rules(cluster_role) == CLUSTER_RULES  # cluster-scoped resources only
    roles = kinds(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _rules(role) == NAMESPACED_RULES
    bindings = {b["metadata"]["namespace"]: b for b in kinds(objects, "RoleBinding")}
    assert set(bindings) == {"team-a", "team-b"}
    sa = one(objects, "ServiceAccount")["metadata"]["name"]
    for b in bindings.values():
        assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"] == roles[0]["metadata"]["name"]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


def test_user_roles_aggregate_to_the_built_in_roles(chart: helm_python.Chart) -> None:
    objects = render(chart)
    user_roles = {o["metadata"]["name"]: o for o in kinds(objects, "ClusterRole")
                  if o["metadata"]["labels"]["app.kubernetes.io/component"] == "rbac"}
    assert set(user_roles) == {f"{RELEASE}-fusedserve-edit", f"{RELEASE}-fusedserve-view"}
    for suffix, (aggregate_labels, rules) in USER_ROLES.items():
        role = user_roles[f"{RELEASE}-fusedserve-{suffix}"]
        assert {k for k, v in role["metadata"]["labels"].items() if v == "true"} == aggregate_labels
        assert _rules(role) == rules
    for role in _operator_roles(objects):
        assert not any(resource.endswith("/scale") for _, resource in _rules(role))
    assert not [o for o in render(chart, TOGGLES["no-user-roles"]) if o["kind"] == "ClusterRole"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "rbac"]


def test_rbac_and_serviceaccount_can_be_brought_by_the_user(chart: helm_python.Chart) -> None:
    rbac_kinds = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    assert not {o["kind"] for o in render(chart, TOGGLES["no-rbac"])} & rbac_kinds
    objects = render(chart, TOGGLES["existing-serviceaccount"])
    assert not kinds(objects, "ServiceAccount")
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(objects, "ClusterRoleBinding")["subjects"][0]["name"] == "ops"


# --- names --------------------------------------------------------------------------------------------------------

def test_names_are_cut_at_63_characters(chart: helm_python.Chart) -> None:
    long_release = "r" * 53  # Helm's longest release name
    helm_python.validate_release_name(long_release)
    for values, name in ((TOGGLES["monitoring-on"], long_release),
                         ({"fullnameOverride": "f" * 80, "monitoring": {"enabled": True}}, RELEASE),
                         ({"nameOverride": "n" * 63, **TOGGLES["namespaced"]}, "x" * 40)):
        objects = render(chart, values, name=name)
        names = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects}
        assert len(names) == len(objects), "two objects of a kind got the same name"
        for obj in objects:
            meta = obj["metadata"]
            if obj["kind"] == "CustomResourceDefinition":
                continue  # <plural>.<group>, fixed
            assert len(meta["name"]) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]), meta
            assert all(len(v) <= 63 for v in meta["labels"].values()), meta["labels"]
        suffixed = [o["metadata"]["name"] for o in objects if o["kind"] in ("Service", "ConfigMap")]
        assert any(n.endswith("-metrics") for n in suffixed)


# --- dashboards ConfigMaps -----------------------------------------------------------------------------------------

def test_dashboards_are_configmaps_for_the_grafana_sidecar(chart: helm_python.Chart) -> None:
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert set(files) == {"speculative.json", "communication.json", "serving.json", "operator.json"}
    maps = kinds(render(chart), "ConfigMap")
    assert len(maps) == len(files)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "fusedserve"}
        assert cm["metadata"]["namespace"] == NAMESPACE
        [(key, text)] = cm["data"].items()
        assert json.loads(text) == json.loads(files[key])
    custom = {"dashboards": {"label": "example.com/dashboard", "labelValue": "yes", "folderAnnotation": "folder",
                             "folder": "LLM", "namespace": "monitoring", "labels": {"team": "ml"}}}
    for cm in kinds(render(chart, custom), "ConfigMap"):
        labels = cm["metadata"]["labels"]
        assert labels["example.com/dashboard"] == "yes" and labels["team"] == "ml" and "grafana_dashboard" not in labels
        assert cm["metadata"]["annotations"] == {"folder": "LLM"} and cm["metadata"]["namespace"] == "monitoring"
    assert not kinds(render(chart, TOGGLES["no-dashboards"]), "ConfigMap")


# --- alerts -------------------------------------------------------------------------------------------------------

def _alerts(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rule = one(objects, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


ALERTS = {"FusedserveAcceptanceLengthLow", "FusedserveAcceptanceLengthDrop", "FusedserveExtraCollectives",
          "FusedserveDeploymentsNotReady", "FusedserveTimeToFirstTokenHigh", "FusedserveOperatorReconcileErrors"}


def test_alerts_take_their_thresholds_from_values(chart: helm_python.Chart) -> None:
    defaults = _alerts(render(chart, TOGGLES["monitoring-on"]))
    assert set(defaults) == ALERTS
    for rule in defaults.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert defaults["FusedserveAcceptanceLengthLow"]["expr"].endswith("< 1.5")
    assert defaults["FusedserveExtraCollectives"]["labels"]["severity"] == "critical"
    tuned = _alerts(render(chart, ci_values(CHART / "ci" / "monitoring-values.yaml")))
    low, drop = tuned["FusedserveAcceptanceLengthLow"], tuned["FusedserveAcceptanceLengthDrop"]
    assert low["expr"].endswith("< 1.8") and low["for"] == "5m"
    assert drop["expr"].endswith("< 0.7") and drop["expr"].count("offset 2h") == 2
    assert tuned["FusedserveExtraCollectives"]["expr"].endswith("> 0")
    ttft = tuned["FusedserveTimeToFirstTokenHigh"]
    assert ttft["expr"].endswith("> 0.5") and ttft["labels"]["severity"] == "critical"
    assert tuned["FusedserveOperatorReconcileErrors"]["expr"].endswith("> 0.05")
    worker_only = _alerts(render(chart, TOGGLES["worker-alerts-only"]))
    assert set(worker_only) == ALERTS - {"FusedserveDeploymentsNotReady", "FusedserveOperatorReconcileErrors"}
    operator_only = _alerts(render(chart, TOGGLES["operator-alerts-only"]))
    assert set(operator_only) == {"FusedserveDeploymentsNotReady", "FusedserveOperatorReconcileErrors"}


# --- NOTES.txt, images ----------------------------------------------------------------------------------------------

def test_notes_say_what_to_apply_next(chart: helm_python.Chart) -> None:
    notes = render_files(chart, None, api_versions=(MONITORING_API,))["fusedserve/templates/NOTES.txt"]
    applied = re.findall(r"kubectl apply -f (\S+)", notes)
    assert applied and all((ROOT / path).is_file() for path in applied)
    assert "kubectl get infd" in notes and 'folder "fusedserve"' in notes
    assert "CRDs: installed and upgraded with this release" in notes and "PrometheusRule" in notes
    no_crds = render_files(chart, {"crds": {"install": False}})["fusedserve/templates/NOTES.txt"]
    assert "kubectl apply --server-side -f crds/" in no_crds
    bare = render_files(chart, {"monitoring": {"enabled": False}, "dashboards": {"enabled": False}})
    assert "monitoring.enabled=true" in bare["fusedserve/templates/NOTES.txt"]


def test_dockerfiles_match_the_package_and_the_crd() -> None:
    operator_file = (ROOT / "docker" / "operator.Dockerfile").read_text()
    worker_file = (ROOT / "docker" / "worker.Dockerfile").read_text()
    # Operator: the package without its (serving) dependencies plus the `operator` extra, read from pyproject.
    assert "--no-deps" in operator_file and "['optional-dependencies']['operator']" in operator_file
    assert not re.search(r"pip (install|wheel)[^\n]*torch", operator_file)
    assert re.search(r"^USER 10001", operator_file, re.MULTILINE)
    assert 'ENTRYPOINT ["fusedserve-operator"]' in operator_file
    # Worker: FlashInfer pinned, Ray matching the CRD's default rayVersion, the package, a non-root user.
    assert "ARG FLASHINFER_VERSION=0.6.18.post1" in worker_file
    ray_default = InferenceDeploymentSpec.model_fields["ray_version"].default
    assert f"ARG RAY_VERSION={ray_default}" in worker_file
    assert "pip install ." in worker_file and "COPY examples" in worker_file
    assert re.search(r"^USER 1000", worker_file, re.MULTILINE)
    for path in ("pyproject.toml", "README.md", "fusedserve", "operator", "worker", "models", "examples"):
        assert (ROOT / path).exists(), path


# --- conventions: images, extras, a subchart with global values ------------------------------------------------------

def test_images_take_registry_digest_and_the_global_registry(chart: helm_python.Chart) -> None:
    objects = render(chart, TOGGLES["images"])
    c = _container(objects)
    assert c["image"] == "mirror.example:5000/fusedserve/operator@sha256:" + "a" * 64
    assert c["args"][c["args"].index("--worker-image") + 1] == "mirror.example:5000/fusedserve/worker:0.1.0-cu130"
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror"}]
    bare = _container(render(chart, {"image": {"registry": "", "repository": "local/operator", "tag": "x"}}))
    assert bare["image"] == "local/operator:x"
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({"image": {"digest": "latest"}})


def test_extras_reach_the_operator_pod(chart: helm_python.Chart) -> None:
    from fusedserve.operator.main import build_parser

    objects = render(chart, TOGGLES["extras"])
    deployment = one(objects, "Deployment")
    pod, c = deployment["spec"]["template"]["spec"], _container(objects)
    assert {"name": "X", "value": "1"} in c["env"] and c["args"][-2:] == ["--status-interval", "5"]
    assert build_parser().parse_args(c["args"]).status_interval == 5
    assert {"name": "ca", "mountPath": "/etc/ssl/custom", "readOnly": True} in c["volumeMounts"]
    assert {"name": "ca", "configMap": {"name": "ca-bundle"}} in pod["volumes"]
    assert pod["affinity"]["nodeAffinity"] and pod["topologySpreadConstraints"][0]["topologyKey"].endswith("zone")
    assert c["readinessProbe"]["periodSeconds"] == 3 and pod["securityContext"]["runAsUser"] == 20000
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "ml-platform", obj["kind"]
    assert not kinds(render(chart, TOGGLES["one-replica"]), "PodDisruptionBudget")
    assert not {"NetworkPolicy", "PodDisruptionBudget"} & {o["kind"] for o in render(chart, TOGGLES["no-network-policy"])}


def test_the_chart_renders_as_a_subchart_with_global_values(tmp_path: Path) -> None:
    """A parent chart vendoring fusedserve under charts/, passing global values (some it does not know)."""
    import shutil

    parent = tmp_path / "platform"
    shutil.copytree(CHART, parent / "charts" / "fusedserve")
    (parent / "templates").mkdir()
    (parent / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: platform-settings\n  namespace: {{ .Release.Namespace }}\n"
        "  labels:\n    app.kubernetes.io/instance: {{ .Release.Name }}\n    app.kubernetes.io/managed-by: Helm\n"
        "    platform: llm\ndata:\n  registry: {{ .Values.global.imageRegistry | quote }}\n")
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0", "type": "application",
        "dependencies": [{"name": "fusedserve", "version": "0.1.0", "condition": "fusedserve.enabled"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.corp.example", "imagePullSecrets": [{"name": "corp"}],
                   "clusterDomain": "cluster.local", "storageClass": "fast"},
        "fusedserve": {"enabled": True, "replicaCount": 3, "commonLabels": {"platform": "llm"}}}))
    report = helm_python.lint(parent, None, strict=True, kube_version="v1.30.0", namespace=NAMESPACE)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    with helm_python.Chart.load(parent) as c:
        objects = render(c, None, name="platform")
    deployment = one(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "registry.corp.example/fusedserve/operator:0.1.0"
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "corp"}]
    for obj in objects:
        validate(obj)
        assert obj["metadata"]["labels"]["platform"] == "llm"
