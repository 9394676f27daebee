"""The engine config ConfigMap: the runtime part of the spec, as the manifest `fusedserve run` reads (pure).

The head pod mounts it at ``/etc/fusedserve/deployment.yaml``; the group controller there re-reads
it when it changes and rolls engine groups whose revision changed (a new restart token included).
Each RayCluster has its own (``<cluster>-engine-config``): during a rollout to a new cluster the old
one keeps serving the config it was built for. The runtime sees only ``DeploymentSpec``'s fields: the
model's URI becomes the local path the pods mount (model_source.py), Kubernetes-only serving fields
(the API key's Secret) stay out, and the deployment is named by its RFC 1035 base name.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from fusedserve.worker.spec import API_VERSION, KIND, DeploymentSpec, ModelSpec, ServingSpec

from .api import InferenceDeploymentSpec
from .model_source import ModelSources
from .naming import ANNOTATION_CONFIG_HASH, ANNOTATION_RESTART_TOKEN, Owner

CONFIG_DIR = "/etc/fusedserve"
CONFIG_FILE = "deployment.yaml"


def runtime_manifest(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The manifest of ``worker.config``: only ``DeploymentSpec``'s fields (no image, placement...)."""
    runtime = spec.model_dump(by_alias=True, mode="json", exclude_none=True,
                              include=set(DeploymentSpec.model_fields))
    sources = ModelSources.of(spec)
    model = spec.model.model_dump(by_alias=True, mode="json", exclude_none=True, include=set(ModelSpec.model_fields))
    runtime["model"] = {**model, "path": sources.model.local_path, "name": spec.model.name or owner.name}
    runtime["serving"] = spec.serving.model_dump(by_alias=True, mode="json", exclude_none=True,
                                                 include=set(ServingSpec.model_fields))
    if sources.draft is not None:
        runtime["speculative"]["draftModel"] = sources.draft.local_path
    metadata: dict[str, Any] = {"name": owner.base, "namespace": owner.namespace}
    if spec.restart_token:
        metadata["annotations"] = {ANNOTATION_RESTART_TOKEN: spec.restart_token}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": runtime}


def config_text(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    return yaml.safe_dump(runtime_manifest(owner, spec), sort_keys=True)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def desired_config_map(owner: Owner, spec: InferenceDeploymentSpec, ray_cluster: str) -> dict[str, Any]:
    text = config_text(owner, spec)
    meta = owner.metadata(owner.config_map(ray_cluster), "engine-config", {ANNOTATION_CONFIG_HASH: config_hash(text)})
    meta["labels"]["ray.io/cluster"] = ray_cluster  # deleted with its cluster
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": meta,
        "data": {CONFIG_FILE: text},
    }
