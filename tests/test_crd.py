"""The InferenceDeployment CRD: generated, not stale, and it accepts and rejects what it should.

No API server here (TESTING.md), so the CRD's openAPIV3Schema is checked with `jsonschema`
(draft 4, whose boolean exclusiveMinimum is OpenAPI v3.0's) (after applying its defaults, as the API server does) and its x-kubernetes-validations rules
with a CEL library (`common-expression-language`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from fusedserve.operator.crd import CRD_FILE, crd, render

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = _defaulted(sub, out[name])
    return out


def _cel(rule: str, self_value: Any, old: Any = None) -> bool:
    import cel

    ctx = cel.Context()
    ctx.add_variable("self", self_value)
    if old is not None:
        ctx.add_variable("oldSelf", old)
    return bool(cel.evaluate(rule, ctx))


def _rules(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[str]:
    errors = []
    for r in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in r["rule"] and old is None:
            continue
        if not _cel(r["rule"], value, old):
            errors.append(r["message"])
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += _rules(sub, value[name], old.get(name) if isinstance(old, dict) else None, f"{path}.{name}")
    return errors


def validate(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    doc = _defaulted(SCHEMA, doc)
    old = _defaulted(SCHEMA, old) if old is not None else None
    errors = [e.message for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(doc)]
    if errors:
        return errors
    return _rules(SCHEMA["properties"]["spec"], doc["spec"], old["spec"] if old else None, "spec")


def manifest(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"path": "/models/llama"}}
    base.update(spec)
    return {"apiVersion": "fusedserve.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "default"}, "spec": base}


def test_committed_crd_is_generated_from_the_api_types() -> None:
    committed = (ROOT / "crds" / CRD_FILE).read_text()
    assert committed == render(), "crds/ is stale: run `python -m fusedserve.operator.crd > crds/" + CRD_FILE + "`"


def test_crd_shape() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "TP", "DP", "EP",
                                                                        "Accept", "Weights", "Age"]
    assert [c for c in version["additionalPrinterColumns"] if c.get("priority")] == [  # kubectl get -o wide
        {"name": "Weights", "type": "string", "jsonPath": ".status.quantization.weights", "priority": 1}]
    assert crd()["spec"]["names"]["shortNames"] == ["infd"]
    text = render()
    assert "$ref" not in text and "anyOf" not in text and "additionalProperties: false" not in text


def test_examples_are_valid() -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceDeployment":
                assert validate(doc) == [], path


def test_minimal_and_full_manifests_are_valid() -> None:
    assert validate(manifest()) == []
    full = manifest(
        replicas=2, parallelism={"tensor": 8, "data": 8, "expert": 8, "dataParallelAttention": True},
        communication={"allReduceFusion": "on"},
        speculative={"method": "eagle3", "draftModel": "/models/draft", "numSteps": 3, "topK": 4,
                     "numDraftTokens": 8},
        serving={"port": 8000, "maxBatchTokens": 8192, "maxSequences": 256, "kvCacheFraction": 0.9,
                 "drainGracePeriodSeconds": 60, "maxRequestBytes": 1 << 20, "maxSequencesPerRequest": 64,
                 "headerTimeoutSeconds": 5, "bodyTimeoutSeconds": 10.5, "sendTimeoutSeconds": 30,
                 "maxConnections": 256, "auth": {"health": "public", "metrics": "apiKey"}},
        placement={"nodeSelector": {"gpu": "h200"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                                     "effect": "NoSchedule"}],
                   "gpusPerNode": 8},
        rollout={"maxUnavailable": 0, "maxSurge": 1, "clusterDeletionDelaySeconds": 30}, suspend=False,
        restartToken="r1", monitoring={"podMonitor": True}, image="ghcr.io/fusedserve/worker:0.1.0",
        imagePullPolicy="IfNotPresent",
        modelStorage={"cache": {"claimName": "models", "sizeLimit": "500Gi"},
                      "huggingFace": {"tokenSecret": {"name": "hf", "key": "token"}, "endpoint": "https://hf.example"},
                      "s3": {"credentialsSecret": {"name": "s3"}, "endpoint": "https://s3.example", "region": "us-east-1"}},
        head={"resources": {"requests": {"cpu": 4, "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}},
              "affinity": {"nodeAffinity": {}}, "priorityClassName": "high", "serviceAccountName": "llm",
              "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
              "securityContext": {"readOnlyRootFilesystem": True}},
        workers={"schedulerName": "volcano", "topologySpreadConstraints": [{"maxSkew": 1}],
                 "volumes": [{"name": "cache", "emptyDir": {}}], "volumeMounts": [{"name": "cache", "mountPath": "/c"}],
                 "imagePullSecrets": [{"name": "regcred"}], "tolerations": [{"key": "k", "operator": "Exists"}]},
        service={"type": "LoadBalancer", "annotations": {"a": "b"}},
        networkPolicy={"enabled": True, "apiClients": [{"namespaceSelector": {"matchLabels": {"a": "b"}},
                                                        "podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8"}}]},
        podDisruptionBudget={"enabled": True, "maxUnavailable": 2})
    full["spec"]["model"] = {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "dtype": "bfloat16"}
    full["spec"]["serving"]["apiKeySecret"] = {"name": "api-keys", "key": "default"}
    assert validate(full) == []
    for uri in ("s3://bucket/prefix/x", "pvc://models/llama", "pvc://models", "/models/llama", "hf://gpt2"):
        assert validate(manifest(model={"uri": uri})) == [], uri


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"parallelism": {"tensor": 4, "data": 3, "dataParallelAttention": True}}, "divisible by spec.parallelism.data"),
    ({"parallelism": {"tensor": 4, "expert": 3}}, "divisible by spec.parallelism.expert"),
    ({"parallelism": {"tensor": 2, "data": 1, "dataParallelAttention": True}}, "needs spec.parallelism.data > 1"),
    ({"parallelism": {"tensor": 4, "data": 2}}, "needs dataParallelAttention: true"),
    ({"speculative": {"method": "eagle3", "draftModel": ""}}, "should be non-empty"),
    ({"speculative": {"method": "eagle3"}}, "'draftModel' is a required property"),
    ({"speculative": {"draftModel": "/d", "numSteps": 5, "topK": 1, "numDraftTokens": 4}},
     "numDraftTokens must be >= numSteps + 1"),
    ({"speculative": {"draftModel": "/d", "method": "medusa"}}, "'medusa' is not one of ['eagle3']"),
    ({"parallelism": {"tensor": 16}, "placement": {"gpusPerNode": 8}}, "must fit one node"),
    ({"parallelism": {"tensor": 0}}, "0 is less than the minimum of 1"),
    ({"parallelism": {"tensor": "2"}}, "'2' is not of type 'integer'"),
    ({"replicas": -1}, "-1 is less than the minimum of 0"),
    ({"communication": {"allReduceFusion": "maybe"}}, "'maybe' is not one of ['auto', 'on', 'off']"),
    ({"serving": {"port": 80}}, "80 is less than the minimum of 1024"),
    ({"serving": {"kvCacheFraction": 1.5}}, "1.5 is greater than the maximum of 0.98"),
    ({"serving": {"maxSequences": 0}}, "0 is less than the minimum of 1"),
    ({"model": {"path": ""}}, "should be non-empty"),
    ({"model": {"dtype": "float8", "path": "/m"}},
     "'float8' is not one of ['auto', 'float32', 'bfloat16', 'float16']"),
    ({"model": {"quantization": "int4", "path": "/m"}}, "'int4' is not one of ['auto', 'fp8', 'none']"),
    ({"model": {"path": "x" * 2000}}, "is too long"),
    ({"rayVersion": "latest"}, "does not match"),
    ({"placement": {"tolerations": [{"operator": "Sometimes"}]}}, "'Sometimes' is not one of ['Exists', 'Equal']"),
    ({"placement": {"gpusPerNode": 0}}, "0 is less than the minimum of 1"),
    ({"rollout": {"maxSurge": -1}}, "-1 is less than the minimum of 0"),
    ({"restartToken": "t" * 100}, "is too long"),
    ({"suspend": "yes"}, "'yes' is not of type 'boolean'"),
    ({"model": {"uri": "ftp://host/model"}}, "does not match"),
    ({"model": {"uri": "hf://org/name@"}}, "does not match"),
    ({"model": {"uri": "s3://UPPER/x"}}, "does not match"),
    ({"model": {"uri": "hf://org/name", "path": "/m"}}, "exactly one of uri"),
    ({"model": {"dtype": "float32"}}, "exactly one of uri"),
    ({"serving": {"apiKeySecret": {"name": "Keys", "key": "k"}}}, "does not match"),
    ({"serving": {"apiKeySecret": {"name": "keys"}}}, "'key' is a required property"),
    ({"modelStorage": {"cache": {"sizeLimit": "lots"}}}, "does not match"),
    ({"modelStorage": {"huggingFace": {"tokenSecret": {"name": "t", "key": "a b"}}}}, "does not match"),
    ({"head": {"priorityClassName": "Not_Valid"}}, "does not match"),
    ({"workers": {"env": [{"name": "1X", "value": "v"}]}}, "does not match"),
    ({"workers": {"volumeMounts": [{"name": "v"}]}}, "'mountPath' is a required property"),
    ({"service": {"type": "ExternalName"}}, "is not one of ['ClusterIP', 'NodePort', 'LoadBalancer']"),
    ({"networkPolicy": {"apiClients": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]}},
     "is not one of ['In', 'NotIn', 'Exists', 'DoesNotExist']"),
    ({"podDisruptionBudget": {"maxUnavailable": -1}}, "-1 is less than the minimum of 0"),
    ({"rollout": {"clusterDeletionDelaySeconds": 7200}}, "7200 is greater than the maximum of 3600"),
    ({"imagePullPolicy": "Sometimes"}, "is not one of ['Always', 'IfNotPresent', 'Never']"),
    ({"serving": {"drainGracePeriodSeconds": -1}}, "-1 is less than the minimum of 0"),
    ({"serving": {"auth": {"health": "apiKey"}}}, "readiness probe (the kubelet) sends no API key"),
]


@pytest.mark.parametrize("spec,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_manifest_is_rejected_with_its_message(spec: dict[str, Any], message: str) -> None:
    doc = manifest()
    doc["spec"].update(spec)
    errors = validate(doc)
    assert any(message in e for e in errors), errors


def test_missing_spec_model_is_rejected() -> None:
    doc = manifest()
    del doc["spec"]["model"]
    assert any("'model' is a required property" in e for e in validate(doc))


def test_parallelism_cannot_be_rolled() -> None:
    old = manifest(parallelism={"tensor": 2})
    new = manifest(parallelism={"tensor": 4})
    assert "spec.parallelism is immutable" in " ".join(validate(new, old))
    assert validate(manifest(replicas=3, parallelism={"tensor": 2}), old) == []


def test_pydantic_and_crd_agree_on_a_valid_manifest() -> None:
    from fusedserve.operator.api import InferenceDeployment

    doc = manifest(parallelism={"tensor": 4, "data": 2, "dataParallelAttention": True, "expert": 2})
    assert validate(doc) == []
    InferenceDeployment.model_validate(doc)


def test_eagle3_rule_needs_a_draft_model_even_without_the_schema() -> None:
    spec = _defaulted(SCHEMA, manifest(speculative={"method": "eagle3", "numSteps": 3, "topK": 1}))["spec"]
    assert "spec.speculative.method eagle3 needs spec.speculative.draftModel" in _rules(
        SCHEMA["properties"]["spec"], spec, None, "spec")
