"""The operator's pure planners: desired children as golden files, sizing, names, spec errors.

Golden files live in tests/golden/operator/; regenerate on purpose with
``FUSEDSERVE_REGEN_GOLDEN=1 pytest tests/test_operator_children.py`` and review the diff.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusedserve.operator.children import desired_children, parse_spec
from fusedserve.operator.engine_config import runtime_manifest
from fusedserve.operator.naming import Owner
from fusedserve.operator.ray_cluster import worker_sizing
from fusedserve.worker.spec import RuntimeConfig, SpecError, parse_manifest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "operator"


def _example(name: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / name).read_text())
    body["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    return body


def _with(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"].update(spec)
    return out


PLACED = _with(_example("02-tiny-code-tp2.yaml"), replicas=3, image="registry.example/fusedserve/worker:1.2.3",
               placement={"nodeSelector": {"pool": "h200"}, "gpuType": "NVIDIA-H200", "gpusPerNode": 4,
                          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
               rollout={"maxSurge": 1}, resources={"gpusPerRank": 1, "cpu": "16", "memory": "128Gi"},
               restartToken="2026-11-30")
CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "01-tiny-code": (_example("01-tiny-code.yaml"), True),
    "02-tiny-code-tp2": (_example("02-tiny-code-tp2.yaml"), True),
    "03-tiny-moe-dp-ep": (_example("03-tiny-moe-dp-ep.yaml"), False),  # no PodMonitor CRD in the cluster
    "placed-tp2x3": (PLACED, True),
    "suspended": (_with(_example("01-tiny-code.yaml"), suspend=True), True),
}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's manifest) as literal blocks, so golden diffs read well."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


def _render(body: dict[str, Any], monitor_crd: bool) -> str:
    children = desired_children(Owner.of(body), parse_spec(body), monitor_crd)
    return yaml.dump_all(children.all(), Dumper=_Dumper, sort_keys=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_children_match_golden_files(case: str) -> None:
    body, monitor_crd = CASES[case]
    text = _render(body, monitor_crd)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("FUSEDSERVE_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run with FUSEDSERVE_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{case}: desired children changed; regenerate on purpose and review"


def test_every_child_is_owned_and_labelled() -> None:
    body = CASES["placed-tp2x3"][0]
    for obj in desired_children(Owner.of(body), parse_spec(body), True).all():
        meta = obj["metadata"]
        assert meta["namespace"] == "default"
        assert meta["ownerReferences"] == [{
            "apiVersion": "fusedserve.io/v1alpha1", "kind": "InferenceDeployment", "name": "tiny-code-tp2",
            "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["fusedserve.io/deployment"] == "tiny-code-tp2"


def test_config_map_is_a_manifest_the_runtime_accepts() -> None:
    body = CASES["placed-tp2x3"][0]
    children = desired_children(Owner.of(body), parse_spec(body), True)
    manifest = parse_manifest(yaml.safe_load(children.config_map["data"]["deployment.yaml"]))
    rc = RuntimeConfig.from_manifest(manifest)
    assert (rc.tensor, rc.replicas, rc.restart_token) == (2, 3, "2026-11-30")
    # A new restart token is a new revision (every group is recreated); replicas alone is not.
    other = _with(body, restartToken="2026-12-01")
    rc2 = RuntimeConfig.from_manifest(parse_manifest(runtime_manifest(Owner.of(other), parse_spec(other))))
    rc3 = RuntimeConfig.from_manifest(parse_manifest(runtime_manifest(Owner.of(body), parse_spec(
        _with(body, replicas=5)))))
    assert rc2.revision != rc.revision and rc3.revision == rc.revision


@pytest.mark.parametrize(("tp", "per_node", "replicas", "surge", "want"), [
    (1, 8, 1, 1, (1, 2, 2)),      # one pod with 2 GPUs (1 group + 1 surge group)
    (2, 4, 3, 1, (2, 4, 4)),      # 4 groups of 2 GPUs, 2 per 4-GPU node
    (8, 8, 2, 0, (2, 8, 2)),      # whole nodes
    (4, 8, 3, 1, (2, 8, 4)),
    (2, 8, 0, 1, (0, 0, 0)),      # scaled to zero: no worker pods
])
def test_worker_sizing(tp: int, per_node: int, replicas: int, surge: int, want: tuple[int, int, int]) -> None:
    body = _with(_example("01-tiny-code.yaml"), replicas=replicas, parallelism={"tensor": tp},
                 placement={"gpusPerNode": per_node}, rollout={"maxSurge": surge})
    sizing = worker_sizing(parse_spec(body))
    assert (sizing.pods, sizing.gpus_per_pod, sizing.groups) == want


def test_long_names_are_cut_with_a_hash_and_stay_unique() -> None:
    a = _example("01-tiny-code.yaml")
    a["metadata"]["name"] = "a" * 60 + "-x1"
    b = copy.deepcopy(a)
    b["metadata"]["name"] = "a" * 60 + "-x2"
    ca, cb = (desired_children(Owner.of(x), parse_spec(x), True) for x in (a, b))
    for x, y in zip(ca.all(), cb.all()):
        assert len(x["metadata"]["name"]) <= 63 and x["metadata"]["name"] != y["metadata"]["name"]
    assert len(ca.ray_cluster["metadata"]["name"]) <= 40


@pytest.mark.parametrize(("spec", "message"), [
    ({"model": {"path": "m"}, "parallelism": {"tensor": 3, "data": 2, "dataParallelAttention": True}},
     "data=2 must divide tensor=3"),
    ({"model": {"path": "m"}, "parallelism": {"tensor": 16}, "placement": {"gpusPerNode": 8}},
     "exceeds spec.placement.gpusPerNode=8"),
    ({"model": {"path": "m"}, "replicas": -1}, "spec.replicas"),
    ({"model": {"path": "m"}, "speculative": {"draftModel": "d"},
      "parallelism": {"tensor": 2, "data": 2, "dataParallelAttention": True}}, "EAGLE3 with parallelism"),
    ({"model": {"path": "m"}, "replicsa": 2}, "spec.replicsa: Extra inputs are not permitted"),
    ({"modle": {"path": "m"}}, "spec.model: Field required"),
    ("not a mapping", "spec: must be a mapping"),
])
def test_invalid_specs_name_the_field(spec: Any, message: str) -> None:
    body = {"apiVersion": "fusedserve.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "bad", "namespace": "default", "uid": "u"}, "spec": spec}
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_spec(body)


def test_a_name_the_runtime_cannot_use_is_a_spec_error() -> None:
    body = _example("01-tiny-code.yaml")
    body["metadata"]["name"] = "Not_A_DNS_Label"
    with pytest.raises(SpecError, match="metadata.name"):
        parse_spec(body)


def test_the_operator_imports_neither_torch_nor_ray() -> None:
    import subprocess
    import sys

    code = ("import sys, fusedserve.operator.handlers, fusedserve.operator.main; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
