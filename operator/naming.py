"""Names, labels and owner references of an InferenceDeployment's children (pure).

Every child is named from the deployment's name, so a restarted operator finds what it made
before; names longer than Kubernetes allows are cut and given a short hash of the full name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from fusedserve.worker.spec import RESTART_TOKEN_ANNOTATION

from .api import GROUP, KIND, VERSION

LABEL_DEPLOYMENT = "fusedserve.io/deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_CONFIG_HASH = "fusedserve.io/config-hash"
ANNOTATION_RESTART_TOKEN = RESTART_TOKEN_ANNOTATION
# KubeRay names the head Service "<cluster>-head-svc" and pods "<cluster>-<group>-worker-<5>":
# a RayCluster name of at most 40 characters keeps them all within 63.
RAY_CLUSTER_NAME_MAX = 40
DNS_LABEL_MAX = 63


def truncated(name: str, limit: int) -> str:
    """``name`` if it fits, else its first characters + "-" + 8 hex characters of its hash."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:limit - 9].rstrip('-')}-{digest}"


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment that children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta.get("namespace") or "default", meta.get("uid", ""))

    @property
    def ray_cluster(self) -> str:
        return truncated(self.name, RAY_CLUSTER_NAME_MAX)

    @property
    def config_map(self) -> str:
        return truncated(f"{self.name}-engine-config", DNS_LABEL_MAX)

    @property
    def service(self) -> str:
        return truncated(self.name, DNS_LABEL_MAX)

    @property
    def pod_monitor(self) -> str:
        return truncated(self.name, DNS_LABEL_MAX)

    @property
    def selector(self) -> str:
        """The label selector of the deployment's pods (``status.selector``, the scale subresource)."""
        return f"{LABEL_DEPLOYMENT}={self.name}"

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "fusedserve",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/managed-by": "fusedserve-operator",
            LABEL_COMPONENT: component,
            LABEL_DEPLOYMENT: self.name,
        }

    def owner_reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}

    def metadata(self, name: str, component: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": self.labels(component),
                                "ownerReferences": [self.owner_reference()]}
        if annotations:
            meta["annotations"] = annotations
        return meta
