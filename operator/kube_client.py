"""The operator's few Kubernetes API calls, on plain JSON objects (the only module that talks to the API).

Children are applied idempotently: create, or on AlreadyExists read the object and merge-patch
the fields the operator owns (labels, annotations, ownerReferences, spec/data) when they differ,
so an operator restarted mid-way never duplicates a child. Login: in-cluster service account,
else the kubeconfig (``KUBECONFIG``), the same credentials kopf uses.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Outcome = Literal["created", "updated", "unchanged"]
MERGE_PATCH = "application/merge-patch+json"
OWNED_TOP_LEVEL = ("spec", "data")  # besides metadata labels/annotations/ownerReferences


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "ray.io/v1"
    plural: str

    def collection(self, namespace: str) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{base}/namespaces/{namespace}/{self.plural}"


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("v1", "configmaps"),
    "Service": Kind("v1", "services"),
    "RayCluster": Kind("ray.io/v1", "rayclusters"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "InferenceDeployment": Kind("fusedserve.io/v1alpha1", "inferencedeployments"),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _owned(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata", {})
    out: dict[str, Any] = {"metadata": {k: meta.get(k) for k in ("labels", "annotations", "ownerReferences")
                                        if k in meta}}
    for k in OWNED_TOP_LEVEL:
        if k in obj:
            out[k] = obj[k]
    return out


def _contains(have: Any, want: Any) -> bool:
    """Does ``have`` hold ``want`` (maps: every wanted key equal; lists and scalars: equal)?

    Servers add defaults (e.g. a Service's clusterIP, a port's protocol); those are not differences.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_contains(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(_contains, have, want))
    return bool(have == want)


class KubeClient:
    def __init__(self, api_client: Any | None = None) -> None:
        if api_client is None:
            api_client = _login()
        self.api = api_client

    # --- raw requests ------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                timeout: float = 30.0) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(method, path, header_params=headers, body=body,
                                          auth_settings=["BearerToken"])
        resp = self.api.call_api(*params, _request_timeout=timeout)
        raw = resp.read() if hasattr(resp, "read") else resp.data
        text = raw.decode() if isinstance(raw, bytes) else (raw or "")
        if resp.status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                message = text
            raise KubeError(resp.status, message)
        return json.loads(text) if text else None

    # --- objects -------------------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.request("GET", f"{KINDS[kind].collection(namespace)}/{name}")
            return obj
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: dict[str, Any]) -> Outcome:
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        collection = kind.collection(meta["namespace"])
        try:
            self.request("POST", collection, obj)
            return "created"
        except KubeError as e:
            if e.status != 409:
                raise
        existing = self.get(obj["kind"], meta["namespace"], meta["name"])
        if existing is None:  # deleted in between: the next reconcile creates it
            raise KubeError(409, f"{obj['kind']} {meta['name']} vanished while being applied")
        want = _owned(obj)
        if _contains(existing, want):
            return "unchanged"
        self.request("PATCH", f"{collection}/{meta['name']}", want, content_type=MERGE_PATCH)
        return "updated"

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            self.request("DELETE", f"{KINDS[kind].collection(namespace)}/{name}",
                         {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    def crd_exists(self, name: str) -> bool:
        """e.g. ``podmonitors.monitoring.coreos.com``"""
        try:
            self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            return True
        except KubeError as e:
            if e.status in (403, 404):
                return False
            raise


def _login() -> Any:
    import os

    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:  # $KUBECONFIG read now (the library reads it once, when first imported)
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
    return client.ApiClient(configuration=cfg)
