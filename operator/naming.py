"""Names, labels and owner references of an InferenceDeployment's children (pure).

Every child is named from the deployment's name, so a restarted operator (or a second replica) finds
what it made before. The API server admits any DNS subdomain as the deployment's name (up to 253
characters, dots, a leading digit); children need less: Services and RayClusters (KubeRay names a
Service after the cluster) take RFC 1035 labels, label values at most 63 characters. A name that does
not fit is made to fit — dots become dashes, a leading digit gets a letter, the rest is cut — and gets
8 hex characters of the full name's hash, so two deployments never share a child.

RayClusters carry the revision of their pod templates (``<base>-<revision>``): a change that needs new
pods is a new cluster beside the old one (rollout.py), never an in-place edit KubeRay would not roll.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from fusedserve.worker.spec import RESTART_TOKEN_ANNOTATION

from .api import GROUP, KIND, VERSION

LABEL_DEPLOYMENT = "fusedserve.io/deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_CLUSTER = "ray.io/cluster"  # KubeRay's label on a RayCluster's pods
LABEL_NODE_TYPE = "ray.io/node-type"
ANNOTATION_CONFIG_HASH = "fusedserve.io/config-hash"
ANNOTATION_RESTART_TOKEN = RESTART_TOKEN_ANNOTATION
ANNOTATION_REVISION = "fusedserve.io/pod-revision"
ANNOTATION_RETIRED_AT = "fusedserve.io/retired-at"  # set on a RayCluster the Service no longer selects
MANAGED_BY = "fusedserve-operator"
# KubeRay names the head Service "<cluster>-head-svc" and pods "<cluster>-<group>-worker-<5>":
# a RayCluster name of at most 40 characters keeps them all within 63.
RAY_CLUSTER_NAME_MAX = 40
REVISION_LENGTH = 5  # hex characters of the pod-template revision in a RayCluster's name
DNS_LABEL_MAX = 63
_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def short_hash(text: str, n: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def truncated(name: str, limit: int) -> str:
    """``name`` if it fits, else its first characters + "-" + 8 hex characters of its hash."""
    if len(name) <= limit:
        return name
    return f"{name[:limit - 9].rstrip('-')}-{short_hash(name)}"


def fitted(name: str, limit: int) -> str:
    """``name`` as an RFC 1035 label of at most ``limit`` characters; changed names carry their hash."""
    if len(name) <= limit and _RFC1035.match(name):
        return name
    clean = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not clean or not clean[0].isalpha():
        clean = f"d-{clean}".rstrip("-")
    head = clean[:limit - 9].rstrip("-")
    return f"{head}-{short_hash(name)}"


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
    def base(self) -> str:
        """The deployment's name as an RFC 1035 label (itself when it is one): children's names, labels,
        and the name the runtime knows the deployment by (placement groups, metric labels)."""
        return fitted(self.name, DNS_LABEL_MAX)

    def ray_cluster(self, revision: str) -> str:
        return f"{fitted(self.name, RAY_CLUSTER_NAME_MAX - REVISION_LENGTH - 1)}-{revision[:REVISION_LENGTH]}"

    @staticmethod
    def config_map(ray_cluster: str) -> str:
        """Each RayCluster has its own engine config: an old cluster keeps serving what it was built for."""
        return f"{ray_cluster}-engine-config"

    @property
    def service(self) -> str:
        return self.base

    @property
    def pod_monitor(self) -> str:
        return self.base

    @property
    def network_policy(self) -> str:
        return self.base

    @property
    def disruption_budget(self) -> str:
        return self.base

    @property
    def ray_token_secret(self) -> str:
        return truncated(f"{self.base}-ray-token", DNS_LABEL_MAX)

    @property
    def selector(self) -> str:
        """The label selector of the deployment's pods (``status.selector``, the scale subresource)."""
        return f"{LABEL_DEPLOYMENT}={self.base}"

    def pod_labels(self) -> dict[str, str]:
        """Labels every pod of the deployment carries (NetworkPolicy, PodDisruptionBudget, PodMonitor)."""
        return {LABEL_DEPLOYMENT: self.base}

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "fusedserve",
            "app.kubernetes.io/instance": self.base,
            "app.kubernetes.io/managed-by": MANAGED_BY,
            LABEL_COMPONENT: component,
            LABEL_DEPLOYMENT: self.base,
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

    def owns(self, obj: dict[str, Any]) -> bool:
        """Is ``obj`` a child of this deployment (its controller reference is this object's uid)?"""
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        return any(r.get("uid") == self.uid and r.get("kind") == KIND and r.get("controller") for r in refs)
