"""Resource types the emulated API server serves, and its discovery documents.

A ``ResourceType`` is everything the server knows about one group/version/plural: the names used by
discovery (kind, short names, categories), scope, the status and scale subresources, the printer
columns and, for CRD-defined types, the OpenAPI schema used for defaulting. Built-in types are listed
here; CRD-defined ones come from ``types_from_crd`` when a CustomResourceDefinition is stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import kmock

OBJECT_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
SUBRESOURCE_VERBS = ["get", "patch", "update"]


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry of a CRD version."""

    name: str
    type: str  # string | integer | number | boolean | date
    json_path: str
    format: str = ""
    description: str = ""
    priority: int = 0


AGE_COLUMN = PrinterColumn("Age", "date", ".metadata.creationTimestamp")


@dataclass(frozen=True)
class ScaleSpec:
    """A CRD's ``subresources.scale``: where the replicas and the selector live in the object."""

    spec_replicas_path: str
    status_replicas_path: str
    label_selector_path: str | None = None


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False
    scale: ScaleSpec | None = None
    columns: tuple[PrinterColumn, ...] = ()  # empty: NAME + AGE
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    list_kind: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> kmock.resource:
        return kmock.resource(group=self.group, version=self.version, plural=self.plural)

    @property
    def group_resource(self) -> str:
        """e.g. ``inferencedeployments.fusedserve.io`` or ``configmaps`` (as in error messages)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def kind_of_list(self) -> str:
        return self.list_kind or f"{self.kind}List"

    @property
    def printer_columns(self) -> tuple[PrinterColumn, ...]:
        return self.columns or (AGE_COLUMN,)

    def subresources(self) -> list[str]:
        return (["status"] if self.has_status else []) + (["scale"] if self.scale else [])

    def discovery_entries(self) -> list[dict[str, Any]]:
        """The APIResource entries of an APIResourceList: the resource, then its subresources."""
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": OBJECT_VERBS,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        if self.has_status:
            entries.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                            "kind": self.kind, "verbs": SUBRESOURCE_VERBS})
        if self.scale:
            entries.append({"name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                            "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": SUBRESOURCE_VERBS})
        return entries

    def resource_info(self) -> kmock.ResourceInfo:
        """The same facts in kmock's own discovery record (``KubernetesScaffold.resources``)."""
        return kmock.ResourceInfo(namespaced=self.namespaced, kind=self.kind,
                                  singular=self.singular or self.kind.lower(), verbs=OBJECT_VERBS,
                                  shortnames=self.short_names, categories=self.categories,
                                  subresources=self.subresources())


def _builtin(group: str, version: str, plural: str, kind: str, **kw: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, singular=kind.lower(), **kw)


_WORKLOAD_SCALE = ScaleSpec(".spec.replicas", ".status.replicas")
_EVENT_COLUMNS = (
    PrinterColumn("Last Seen", "date", ".lastTimestamp"),
    PrinterColumn("Type", "string", ".type"),
    PrinterColumn("Reason", "string", ".reason"),
    PrinterColumn("Object", "string", ".involvedObject.name"),
    PrinterColumn("Message", "string", ".message"),
)

BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _builtin("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",), has_status=True),
    _builtin("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _builtin("", "v1", "services", "Service", short_names=("svc",), categories=("all",), has_status=True),
    _builtin("", "v1", "pods", "Pod", short_names=("po",), categories=("all",), has_status=True),
    _builtin("", "v1", "events", "Event", short_names=("ev",), columns=_EVENT_COLUMNS),
    _builtin("apps", "v1", "deployments", "Deployment", short_names=("deploy",), categories=("all",),
             has_status=True, scale=_WORKLOAD_SCALE),
    _builtin("apps", "v1", "statefulsets", "StatefulSet", short_names=("sts",), categories=("all",),
             has_status=True, scale=_WORKLOAD_SCALE),
    _builtin("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _builtin("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",), has_status=True),
    _builtin("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, short_names=("crd", "crds"), has_status=True),
)

CRD_KEY = kmock.resource(group="apiextensions.k8s.io", version="v1", plural="customresourcedefinitions")


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of a CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    result = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or spec.get("subresources") or {}
        scale = subresources.get("scale")
        columns = version.get("additionalPrinterColumns") or spec.get("additionalPrinterColumns") or []
        result.append(ResourceType(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular") or names["kind"].lower(),
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            has_status="status" in subresources,
            scale=ScaleSpec(scale["specReplicasPath"], scale["statusReplicasPath"],
                            scale.get("labelSelectorPath")) if scale is not None else None,
            columns=tuple(PrinterColumn(c["name"], c.get("type", "string"), c["jsonPath"], c.get("format", ""),
                                        c.get("description", ""), int(c.get("priority", 0)))
                          for c in columns),
            schema=(version.get("schema") or spec.get("validation") or {}).get("openAPIV3Schema"),
            list_kind=names.get("listKind", ""),
        ))
    return result


_VERSION_RE = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order, as a sort key (smaller first): v2 > v1 > v1beta2 > v1beta1 > v1alpha1 > other."""
    match = _VERSION_RE.match(version)
    if match is None:
        return (3, 0, 0)
    major, stage, minor = match.groups()
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -int(major), -int(minor or 0))


def api_resource_list(group: str, version: str, types: Iterable[ResourceType]) -> dict[str, Any]:
    resources = [entry for t in sorted(types, key=lambda t: t.plural) for entry in t.discovery_entries()]
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


def api_group(group: str, versions: Iterable[str]) -> dict[str, Any]:
    ordered = sorted(set(versions), key=version_priority)
    entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in ordered]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
            "preferredVersion": entries[0]}


def api_group_list(types: Iterable[ResourceType]) -> dict[str, Any]:
    versions: dict[str, set[str]] = {}
    for t in types:
        if t.group:
            versions.setdefault(t.group, set()).add(t.version)
    groups = [api_group(g, vs) for g, vs in sorted(versions.items())]
    for g in groups:
        del g["kind"], g["apiVersion"]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def crd_status(crd: dict[str, Any], now: str) -> dict[str, Any]:
    """What the CRD controller reports once it serves a CRD: names accepted, established."""
    names = (crd.get("spec") or {}).get("names") or {}
    stored = [v["name"] for v in (crd.get("spec") or {}).get("versions") or [] if v.get("storage")]
    since = (crd.get("metadata") or {}).get("creationTimestamp") or now
    conditions = [
        {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": since,
         "message": "no conflicts found"},
        {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "lastTransitionTime": since,
         "message": "the initial names have been accepted"},
    ]
    return {"conditions": conditions, "acceptedNames": names, "storedVersions": stored}
