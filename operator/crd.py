"""The InferenceDeployment CRD, generated from the API types (pure).

    python -m fusedserve.operator.crd > crds/fusedserve.io_inferencedeployments.yaml
    python -m fusedserve.operator.crd --peering > crds/kopf.dev_peerings.yaml

The second file holds kopf's peering CRDs (ClusterKopfPeering, KopfPeering): operator replicas see
each other through them, and one works while the others wait (main.py).

pydantic's JSON schema is turned into a Kubernetes structural schema (refs inlined, Optional
as nullable, no additionalProperties: false), with CEL rules (``x-kubernetes-validations``)
for what a single field's schema cannot say, printer columns, and the status and scale
subresources. ``tests/test_crd.py`` fails when the committed YAML is stale.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from .api import (
    CATEGORIES,
    GROUP,
    HEALTH_NEEDS_NO_KEY,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)

CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
PEERING_FILE = "kopf.dev_peerings.yaml"

# Rules on spec (self = spec). Messages are what `kubectl apply` shows.
SPEC_RULES: list[dict[str, str]] = [
    {"rule": "has(self.model.uri) != has(self.model.path)",
     "message": "spec.model needs exactly one of uri (hf://, s3://, pvc:// or a path) and path"},
    {"rule": "!has(self.parallelism) || self.parallelism.tensor % self.parallelism.data == 0",
     "message": "spec.parallelism.tensor must be divisible by spec.parallelism.data"},
    {"rule": "!has(self.parallelism) || self.parallelism.tensor % self.parallelism.expert == 0",
     "message": "spec.parallelism.tensor must be divisible by spec.parallelism.expert"},
    {"rule": "!has(self.parallelism) || !self.parallelism.dataParallelAttention || self.parallelism.data > 1",
     "message": "spec.parallelism.dataParallelAttention needs spec.parallelism.data > 1"},
    {"rule": "!has(self.parallelism) || self.parallelism.data == 1 || self.parallelism.dataParallelAttention",
     "message": "spec.parallelism.data > 1 needs dataParallelAttention: true (engine copies are spec.replicas)"},
    {"rule": "!has(self.speculative) || (has(self.speculative.draftModel) && size(self.speculative.draftModel) > 0)",
     "message": "spec.speculative.method eagle3 needs spec.speculative.draftModel"},
    {"rule": "!has(self.speculative) || !has(self.speculative.numDraftTokens) || self.speculative.topK != 1 || "
             "self.speculative.numDraftTokens >= self.speculative.numSteps + 1",
     "message": "spec.speculative.numDraftTokens must be >= numSteps + 1 when topK = 1"},
    {"rule": "!has(self.parallelism) || !has(self.placement) || self.parallelism.tensor <= self.placement.gpusPerNode",
     "message": "an engine group (spec.parallelism.tensor ranks) must fit one node (spec.placement.gpusPerNode)"},
    {"rule": "!has(self.serving) || !has(self.serving.auth) || !has(self.serving.auth.health) || "
             "self.serving.auth.health == 'public'",
     "message": HEALTH_NEEDS_NO_KEY},
]
# Fields a rolling update cannot change (self = the field, oldSelf = its previous value).
IMMUTABLE = {("parallelism",): "spec.parallelism is immutable: create a new InferenceDeployment to re-shard",
             ("placement", "gpusPerNode"): "spec.placement.gpusPerNode is immutable"}

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.parallelism.tensor"},
    {"name": "DP", "type": "integer", "jsonPath": ".spec.parallelism.data"},
    {"name": "EP", "type": "integer", "jsonPath": ".spec.parallelism.expert"},
    {"name": "Accept", "type": "string", "jsonPath": ".status.speculative.acceptanceLength"},
    {"name": "Weights", "type": "string", "jsonPath": ".status.quantization.weights", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "additionalProperties", "$defs", "discriminator"}


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema node -> a Kubernetes structural schema node."""
    node = copy.deepcopy(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        node = {**copy.deepcopy(target), **node}
    if node.get("x-kubernetes-int-or-string"):  # a quantity: integer or string, as core/v1 has it
        return {k: v for k, v in node.items() if k not in _DROP and k != "anyOf"}
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {options} structurally")
        merged = {**structural(options[0], defs), **{k: v for k, v in node.items() if k not in _DROP}}
        if nullable:
            merged["nullable"] = True
        node = merged
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**structural(node.pop("allOf")[0], defs), **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020 (pydantic) gives the bound; OpenAPI v3.0 (Kubernetes) a flag on minimum/maximum
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if node.get("type") == "object" and isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], defs)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("default") is None:
        out.pop("default", None)
    else:
        out["default"] = _without_nulls(out["default"])
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _schema_of(model: Any) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def spec_schema() -> dict[str, Any]:
    spec = _schema_of(InferenceDeploymentSpec)
    spec["x-kubernetes-validations"] = list(SPEC_RULES)
    for path, message in IMMUTABLE.items():
        node = spec
        for part in path:
            node = node["properties"][part]
        node["x-kubernetes-validations"] = [{"rule": "self == oldSelf", "message": message}]
    return spec


def crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": _schema_of(InferenceDeploymentStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "fusedserve"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": CATEGORIES, "listKind": f"{KIND}List"},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def peering_crds() -> list[dict[str, Any]]:
    """kopf's peering kinds (kopf.dev/v1): each operator writes its priority and liveness into ``status``."""
    out = []
    for kind, plural, scope in (("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
                                ("KopfPeering", "kopfpeerings", "Namespaced")):
        out.append({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev", "labels": {"app.kubernetes.io/part-of": "fusedserve"}},
            "spec": {
                "group": "kopf.dev", "scope": scope,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                    "type": "object", "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}],
            },
        })
    return out


def render(peering: bool = False) -> str:
    import yaml

    flag = " --peering" if peering else ""
    header = f"# Generated by `python -m fusedserve.operator.crd{flag}` from operator/crd.py. Do not edit.\n"
    if peering:
        return header + "---\n".join(yaml.safe_dump(c, sort_keys=False, width=120) for c in peering_crds())
    return header.replace("operator/crd.py", "operator/api.py") + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render(peering="--peering" in sys.argv[1:]))
