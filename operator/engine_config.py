"""The engine config ConfigMap: the runtime part of the spec, as the manifest `fusedserve run` reads (pure).

The head pod mounts it at ``/etc/fusedserve/deployment.yaml``; the group controller there re-reads
it when it changes and rolls engine groups whose revision changed (a new restart token included).
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from fusedserve.worker.spec import API_VERSION, KIND, DeploymentSpec

from .api import InferenceDeploymentSpec
from .naming import ANNOTATION_CONFIG_HASH, ANNOTATION_RESTART_TOKEN, Owner

CONFIG_DIR = "/etc/fusedserve"
CONFIG_FILE = "deployment.yaml"


def runtime_manifest(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The manifest of ``worker.config``: only ``DeploymentSpec``'s fields (no image, placement...)."""
    runtime = spec.model_dump(by_alias=True, mode="json", exclude_none=True,
                              include=set(DeploymentSpec.model_fields))
    metadata: dict[str, Any] = {"name": owner.name, "namespace": owner.namespace}
    if spec.restart_token:
        metadata["annotations"] = {ANNOTATION_RESTART_TOKEN: spec.restart_token}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": runtime}


def config_text(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    return yaml.safe_dump(runtime_manifest(owner, spec), sort_keys=True)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def desired_config_map(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    text = config_text(owner, spec)
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": owner.metadata(owner.config_map, "engine-config", {ANNOTATION_CONFIG_HASH: config_hash(text)}),
        "data": {CONFIG_FILE: text},
    }
