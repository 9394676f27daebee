"""How the emulated API server makes an object's next version (pure functions, no I/O).

- ``new_object``: a created object with its system metadata (uid, creationTimestamp, generation).
- ``apply_patch``: merge-patch (RFC 7386), JSON patch (RFC 6902) and strategic-merge patch (merge-patch
  plus the directives kubectl sends: ``$patch``, ``$setElementOrder/<list>``, ``$deleteFromPrimitiveList``).
- ``next_version``: the stored result of an update of the object or of its ``status`` subresource:
  system metadata kept, ``.status`` split per subresource, ``generation`` +1 when anything but
  metadata/status changed.
- ``scale_of`` / ``with_replicas``: the ``autoscaling/v1`` Scale view of an object and its write-back.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from tests.kube import jsonpath
from tests.kube.resources import ResourceType

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Written only by the server; kept from the stored version whatever a client sends.
SERVER_METADATA = ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds",
                   "name", "namespace")


class PatchError(ValueError):
    """The patch cannot be applied (a failed JSON-patch ``test``, a bad path, a malformed body)."""


def apply_defaults(value: Any, schema: dict[str, Any] | None) -> Any:
    """Fill ``default``s of a structural OpenAPI schema into ``value`` in place (top-down, as the API does)."""
    if not schema:
        return value
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                apply_defaults(value[name], prop)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def new_object(body: dict[str, Any], rtype: ResourceType, *, name: str, namespace: str | None,
               uid: str, now: str) -> dict[str, Any]:
    obj = copy.deepcopy(body)
    obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
    meta = obj.setdefault("metadata", {})
    for key in SERVER_METADATA + ("resourceVersion", "managedFields", "selfLink"):
        meta.pop(key, None)
    meta.update({"name": name, "uid": uid, "creationTimestamp": now, "generation": 1})
    if namespace is not None:
        meta["namespace"] = namespace
    if rtype.has_status:
        obj.pop("status", None)  # the status subresource is the only way to write it
    if rtype.schema:
        apply_defaults(obj, rtype.schema)
    return obj


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_list(current: Any, patch: list[Any], order: list[Any] | None) -> list[Any]:
    """A strategic merge of a list whose merge key kubectl told us in ``$setElementOrder``."""
    mergeable = order and all(isinstance(e, dict) and len(e) == 1 for e in order)
    if not mergeable or not isinstance(current, list):
        return [strategic_merge(None, item) for item in patch if not _is_delete(item)]
    assert order is not None
    key = next(iter(order[0]))
    by_key = {item.get(key): item for item in current if isinstance(item, dict)}
    for item in patch:
        if isinstance(item, dict) and _is_delete(item):
            by_key.pop(item.get(key), None)
        elif isinstance(item, dict):
            by_key[item.get(key)] = strategic_merge(by_key.get(item.get(key)), item)
    ordered = [by_key.pop(e[key]) for e in order if e[key] in by_key]
    return ordered + list(by_key.values())


def _is_delete(item: Any) -> bool:
    return isinstance(item, dict) and item.get("$patch") == "delete"


def strategic_merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in value]
        elif key.startswith("$"):
            continue
        elif value is None or _is_delete(value):
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, patch.get(f"$setElementOrder/{key}"))
        else:
            result[key] = strategic_merge(result.get(key), value)
    return result


def apply_patch(obj: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
    kind = content_type.split(";")[0].strip()
    if kind == JSON_PATCH:
        if not isinstance(patch, list):
            raise PatchError("a JSON patch must be a list of operations")
        try:
            result = jsonpatch.apply_patch(obj, patch, in_place=False)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError, TypeError) as exc:
            raise PatchError(f"the JSON patch cannot be applied: {exc}") from exc
    elif kind in (MERGE_PATCH, STRATEGIC_PATCH):
        if not isinstance(patch, dict):
            raise PatchError("a merge patch must be a JSON object")
        result = merge_patch(obj, patch) if kind == MERGE_PATCH else strategic_merge(obj, patch)
    else:
        raise PatchError(f"unsupported patch type {kind!r}")
    if not isinstance(result, dict):
        raise PatchError("the patched object is not a JSON object")
    return dict(result)


def _spec_part(obj: dict[str, Any], rtype: ResourceType) -> dict[str, Any]:
    skip = {"metadata", "status"} if rtype.has_status else {"metadata"}
    return {k: v for k, v in obj.items() if k not in skip}


def next_version(old: dict[str, Any], new: dict[str, Any], rtype: ResourceType,
                 subresource: str | None) -> dict[str, Any]:
    """What the server stores when a client writes ``new`` over ``old`` (the whole object, or its status)."""
    if subresource == "status":
        result = copy.deepcopy(old)
        if "status" in new:
            result["status"] = copy.deepcopy(new["status"])
        else:
            result.pop("status", None)
    else:
        result = copy.deepcopy(new)
        result["apiVersion"], result["kind"] = old["apiVersion"], old["kind"]
        if rtype.has_status:
            result.pop("status", None)
            if "status" in old:
                result["status"] = copy.deepcopy(old["status"])
        meta = result.setdefault("metadata", {})
        for key in SERVER_METADATA:
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        meta["resourceVersion"] = old["metadata"].get("resourceVersion")
    if rtype.schema:
        apply_defaults(result, rtype.schema)
    if _spec_part(result, rtype) != _spec_part(old, rtype):
        result["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
    return result


def scale_of(obj: dict[str, Any], rtype: ResourceType) -> dict[str, Any]:
    """The ``autoscaling/v1`` Scale of an object whose type has a scale subresource."""
    assert rtype.scale is not None
    meta = obj["metadata"]
    status: dict[str, Any] = {"replicas": jsonpath.first(obj, rtype.scale.status_replicas_path, 0) or 0}
    if rtype.scale.label_selector_path:
        selector = jsonpath.first(obj, rtype.scale.label_selector_path)
        if selector:
            status["selector"] = selector
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if k in meta},
        "spec": {"replicas": jsonpath.first(obj, rtype.scale.spec_replicas_path, 0) or 0},
        "status": status,
    }


def with_replicas(obj: dict[str, Any], rtype: ResourceType, scale: dict[str, Any]) -> dict[str, Any]:
    """The object with the Scale's ``spec.replicas`` written to the type's spec replicas path."""
    assert rtype.scale is not None
    replicas = (scale.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise PatchError(f"spec.replicas must be a non-negative integer, got {replicas!r}")
    result = copy.deepcopy(obj)
    jsonpath.set_field(result, rtype.scale.spec_replicas_path, replicas)
    return result
