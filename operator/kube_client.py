"""The operator's few Kubernetes API calls, on plain JSON objects (the only module that talks to the API).

Children are applied with server-side apply under the field manager ``fusedserve-operator`` (forced:
the operator is their controller): the API server merges the fields the operator sets, removes the ones
it set before and no longer sends, and leaves every field another manager owns (KubeRay, an autoscaler,
a user's ``kubectl annotate``) alone. Names are deterministic, so a restarted operator (or a second
replica) applies to the same objects and never duplicates one. Login: in-cluster service account,
else the kubeconfig (``KUBECONFIG``), the same credentials kopf uses.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

import urllib3

log = logging.getLogger(__name__)

Outcome = Literal["created", "updated", "unchanged"]
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "fusedserve-operator"
# Marks written beside the applied configuration (a rollout's retired-at annotation): another manager,
# so the next apply does not remove them.
ROLLOUT_MANAGER = "fusedserve-operator-rollout"


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "ray.io/v1"
    plural: str

    def collection(self, namespace: str | None) -> str:
        """Of a namespace, or (None) of a cluster-scoped kind."""
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{base}/namespaces/{namespace}/{self.plural}" if namespace else f"{base}/{self.plural}"


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("v1", "configmaps"),
    "Secret": Kind("v1", "secrets"),
    "Service": Kind("v1", "services"),
    "Pod": Kind("v1", "pods"),
    "RayCluster": Kind("ray.io/v1", "rayclusters"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets"),
    "InferenceDeployment": Kind("fusedserve.io/v1alpha1", "inferencedeployments"),
    "ClusterKopfPeering": Kind("kopf.dev/v1", "clusterkopfpeerings"),
    "KopfPeering": Kind("kopf.dev/v1", "kopfpeerings"),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


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
        try:
            resp = self.api.call_api(*params, _request_timeout=timeout)
            raw = resp.read() if hasattr(resp, "read") else resp.data
        except (urllib3.exceptions.HTTPError, OSError) as e:  # no answer (yet): a temporary error for the caller
            raise KubeError(0, f"{method} {path}: {e}") from e
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

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": label_selector})
        doc = self.request("GET", f"{KINDS[kind].collection(namespace)}?{query}") or {}
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def apply(self, obj: dict[str, Any]) -> Outcome:
        """Server-side apply of ``obj`` (the whole configuration the operator wants for it)."""
        meta = obj["metadata"]
        before = self.get(obj["kind"], meta["namespace"], meta["name"])
        query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
        path = f"{KINDS[obj['kind']].collection(meta['namespace'])}/{meta['name']}?{query}"
        after = self.request("PATCH", path, json.dumps(obj), content_type=APPLY_PATCH) or {}
        if before is None:
            return "created"
        changed = (after.get("metadata") or {}).get("resourceVersion") != before["metadata"].get("resourceVersion")
        return "updated" if changed else "unchanged"

    def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj`` unless it exists (False then): for what must never be rewritten (a token)."""
        meta = obj["metadata"]
        query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER})
        try:
            self.request("POST", f"{KINDS[obj['kind']].collection(meta.get('namespace'))}?{query}", obj)
            return True
        except KubeError as e:
            if e.status == 409:
                return False
            raise

    def annotate(self, kind: str, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Set (or with None remove) annotations, under the rollout's own field manager."""
        query = urllib.parse.urlencode({"fieldManager": ROLLOUT_MANAGER})
        self.request("PATCH", f"{KINDS[kind].collection(namespace)}/{name}?{query}",
                     {"metadata": {"annotations": annotations}}, content_type=MERGE_PATCH)

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded (None when the Secret or the key is missing)."""
        secret = self.get("Secret", namespace, name)
        raw = ((secret or {}).get("data") or {}).get(key)
        if raw is None:
            return None
        try:
            return base64.b64decode(raw).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None

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
