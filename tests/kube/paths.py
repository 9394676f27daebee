"""Kubernetes API paths: ``/api/v1[/namespaces/<ns>]/<plural>[/<name>[/<subresource>]]`` for the core
group, ``/apis/<group>/<version>/...`` for the others."""

from __future__ import annotations

ApiPath = tuple[str, str, str | None, str | None, str | None, str | None]  # group, version, ns, plural, name, sub


def object_path(group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None,
                subresource: str | None = None) -> str:
    """The path of a collection (no name), an object, or an object's subresource."""
    path = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    for part in (name, subresource):
        if part is not None:
            path += f"/{part}"
    return path


def parse_api_path(path: str) -> ApiPath | None:
    """``(group, version, namespace, plural, name, subresource)`` of an API path, None for others."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    namespace_subresource = group == "" and len(rest) == 3 and rest[2] in ("status", "finalize")
    if len(rest) >= 3 and rest[0] == "namespaces" and not namespace_subresource:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    return group, version, namespace, plural, name, "/".join(rest[2:]) or None

