"""Server-side apply and field ownership (``metadata.managedFields``) for the emulated API server (pure).

Enough of Kubernetes' structured-merge semantics for an operator's tests:

- every write records which manager set which fields: an apply (``PATCH`` with
  ``application/apply-patch+yaml``) under ``Apply``, any other write (create, merge/JSON/strategic patch,
  ``PUT``) under ``Update``, the manager named by ``?fieldManager=`` or else by the User-Agent;
- an apply merges its configuration into the object and *removes* the fields the same manager applied
  before and no longer sends, unless another manager also owns them;
- a field another manager owns with a different value is a conflict (409) unless ``?force=true``,
  which moves the field to the applier; an ``Update`` silently takes the fields it changed.

Simplifications, on purpose: every list is atomic (one field, owned whole: what a CRD's lists are
unless its schema says otherwise; built-in map-lists such as containers are keyed in a real server);
a field's identity is its path of map keys. ``status`` is not tracked for types with a status subresource.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

Path = tuple[str, ...]
APPLY, UPDATE = "Apply", "Update"
# Written by the server or identifying the object: never owned by a manager.
UNOWNED_METADATA = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                              "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"})


class ApplyConflict(ValueError):
    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        text = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {text}")
        self.conflicts = conflicts


@dataclass
class Entry:
    manager: str
    operation: str  # Apply | Update
    api_version: str
    fields: set[Path] = field(default_factory=set)
    time: str = ""


def leaf_paths(obj: Any, tracks_status: bool = True) -> set[Path]:
    """The fields of an object: paths of map keys down to each non-map value (lists are atomic)."""
    out: set[Path] = set()

    def walk(value: Any, path: Path) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, (*path, str(k)))
        else:
            out.add(path)

    for key, value in (obj or {}).items():
        if key in ("apiVersion", "kind") or (key == "status" and not tracks_status):
            continue
        if key == "metadata" and isinstance(value, dict):
            for mk, mv in value.items():
                if mk not in UNOWNED_METADATA:
                    walk(mv, ("metadata", mk))
        else:
            walk(value, (key,))
    return out


_MISSING = object()


def value_at(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _overlaps(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _delete(obj: dict[str, Any], path: Path) -> None:
    """Remove the field at ``path`` and the maps it leaves empty."""
    parents = []
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        parents.append((node, key))
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    for parent, key in reversed(parents):
        if parent[key] == {}:
            del parent[key]
        else:
            break


def _merge(base: Any, config: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(config, dict)):
        return copy.deepcopy(config)
    out = dict(base)
    for k, v in config.items():
        out[k] = _merge(base.get(k), v)
    return out


# --- managedFields as the API shows them (FieldsV1) -------------------------------------------------

def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def from_fields_v1(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in (tree or {}).items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        out |= from_fields_v1(sub, path) if sub else {path}
    return out


def read_entries(obj: dict[str, Any] | None) -> list[Entry]:
    entries = []
    for e in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        entries.append(Entry(e.get("manager", ""), e.get("operation", UPDATE), e.get("apiVersion", ""),
                             from_fields_v1(e.get("fieldsV1") or {}), e.get("time", "")))
    return entries


def write_entries(obj: dict[str, Any], entries: list[Entry]) -> dict[str, Any]:
    """``obj`` with ``metadata.managedFields`` set from ``entries`` (empty ones dropped)."""
    kept = [{"manager": e.manager, "operation": e.operation, "apiVersion": e.api_version, "time": e.time,
             "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(e.fields)} for e in entries if e.fields]
    meta = dict(obj.get("metadata") or {})
    if kept:
        meta["managedFields"] = kept
    else:
        meta.pop("managedFields", None)
    return {**obj, "metadata": meta}


def _entry(entries: list[Entry], manager: str, operation: str, api_version: str, now: str) -> Entry:
    for e in entries:
        if e.manager == manager and e.operation == operation:
            e.api_version, e.time = api_version, now
            return e
    e = Entry(manager, operation, api_version, set(), now)
    entries.append(e)
    return e


# --- the two kinds of write ------------------------------------------------------------------------------

def apply(current: dict[str, Any] | None, config: dict[str, Any], manager: str, *, force: bool,
          tracks_status: bool, now: str) -> dict[str, Any]:
    """The object after ``manager`` applies ``config`` (server-side apply); raises ``ApplyConflict``."""
    entries = read_entries(current)
    applied = leaf_paths(config, tracks_status)
    mine = _entry(entries, manager, APPLY, str(config.get("apiVersion", "")), now)
    others = [e for e in entries if e is not mine]
    base = copy.deepcopy(current) if current is not None else {}
    conflicts = []
    for e in others:
        for theirs in e.fields:
            for p in applied:
                if _overlaps(p, theirs):
                    at = p if len(p) <= len(theirs) else theirs
                    if value_at(base, at) != value_at(config, at):
                        conflicts.append((e.manager, at))
    if conflicts and not force:
        raise ApplyConflict(sorted(set(conflicts)))
    if force:
        for e in others:
            e.fields = {q for q in e.fields if not any(_overlaps(p, q) and (value_at(base, q) != value_at(config, q))
                                                       for p in applied)}
    owned_by_others = set().union(*(e.fields for e in others)) if others else set()
    for gone in mine.fields - applied:
        if not any(_overlaps(gone, q) for q in owned_by_others | applied):
            _delete(base, gone)
    mine.fields = applied
    result = _merge(base, {k: v for k, v in config.items() if tracks_status or k != "status"})
    return write_entries(result, entries)


def record_update(old: dict[str, Any] | None, new: dict[str, Any], manager: str, *, tracks_status: bool,
                  now: str) -> dict[str, Any]:
    """``new`` (written by a non-apply request of ``manager``) with the ownership of what it changed."""
    entries = read_entries(old)
    before = old or {}
    changed = {p for p in leaf_paths(new, tracks_status) if value_at(before, p) != value_at(new, p)}
    removed = {p for p in leaf_paths(before, tracks_status) if value_at(new, p) is _MISSING}
    touched = changed | removed
    for e in entries:
        e.fields = {q for q in e.fields if not any(_overlaps(p, q) for p in touched)}
    if changed:
        _entry(entries, manager, UPDATE, str(new.get("apiVersion", "")), now).fields |= changed
    return write_entries(new, entries)


def owners(obj: dict[str, Any], path: Path) -> list[str]:
    """Managers owning ``path`` (or a field inside it), e.g. for a test's assertion."""
    return sorted({e.manager for e in read_entries(obj) if any(_overlaps(path, q) for q in e.fields)})


# --- request details --------------------------------------------------------------------------------------

def manager_of(field_manager: str | None, user_agent: str) -> str:
    """The field manager of a write: ``?fieldManager=``, else the client's name from its User-Agent."""
    return field_manager or user_agent.split("/")[0].strip() or "unknown"


def checked_config(config: Any, api_version: str, kind: str, name: str) -> dict[str, Any]:
    """An apply configuration for the object ``name`` of this type; raises ValueError with the reason."""
    if not isinstance(config, dict) or not isinstance(config.get("metadata"), dict):
        raise ValueError("an apply configuration must be an object with metadata")  # noqa: TRY004 (a 400)
    if config["metadata"].get("name") not in (None, name):
        raise ValueError("the name of the object does not match the name on the URL")
    if config.get("kind") not in (None, kind) or config.get("apiVersion") not in (None, api_version):
        raise ValueError(f"the apply configuration is not a {api_version} {kind}")
    return config


def same_object(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Equal apart from the times in managedFields: such a write makes no new version (no event)."""
    def strip(o: dict[str, Any]) -> dict[str, Any]:
        meta = dict(o.get("metadata") or {})
        meta["managedFields"] = [{k: v for k, v in e.items() if k != "time"} for e in meta.get("managedFields") or []]
        return {**o, "metadata": meta}
    return strip(new) == strip(old)
