"""Server-side printing: ``meta.k8s.io/v1`` Tables for ``Accept: application/json;as=Table;...``.

Columns are NAME plus the type's printer columns (a CRD's ``additionalPrinterColumns``, or AGE),
evaluated the way the API server's CRD table converter does: the first JSONPath result, typed by the
column type, ``date`` shown as an age ("5s", "3m20s"), a missing value as ``None`` (kubectl: <none>).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from tests.kube import jsonpath
from tests.kube.resources import ResourceType


def wants_table(accept: str) -> bool:
    """Does the Accept header ask for a Table first (kubectl get, without -o json/yaml/name)?"""
    first = accept.split(",")[0].replace(" ", "")
    return "as=Table" in first


def parse_time(value: str) -> datetime.datetime | None:
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError, AttributeError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (the same bands as Kubernetes' ``duration.HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    return f"{years}y{rest}d" if years < 8 and rest else f"{years}y"


def _cell(column_type: str, value: Any, now: datetime.datetime) -> Any:
    if column_type == "date":
        when = parse_time(value) if isinstance(value, str) else None
        return human_duration((now - when).total_seconds()) if when else "<unknown>"
    if column_type == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
        return int(value) if ok else None
    if column_type == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if column_type == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def column_definitions(rtype: ResourceType) -> list[dict[str, Any]]:
    name = {"name": "Name", "type": "string", "format": "name", "priority": 0,
            "description": "Name must be unique within a namespace."}
    return [name] + [{"name": c.name, "type": c.type, "format": c.format, "description": c.description,
                      "priority": c.priority} for c in rtype.printer_columns]


def row(rtype: ResourceType, obj: dict[str, Any], now: datetime.datetime, include_object: str) -> dict[str, Any]:
    cells: list[Any] = [(obj.get("metadata") or {}).get("name", "")]
    for column in rtype.printer_columns:
        values = jsonpath.find(obj, column.json_path)
        cells.append(_cell(column.type, values[0], now) if values and values[0] is not None else None)
    out: dict[str, Any] = {"cells": cells}
    if include_object == "Object":
        out["object"] = obj
    elif include_object != "None":
        out["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                         "metadata": obj.get("metadata") or {}}
    return out


def table(rtype: ResourceType, objects: list[dict[str, Any]], *, resource_version: str,
          include_object: str = "Metadata", now: datetime.datetime | None = None) -> dict[str, Any]:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": column_definitions(rtype),
        "rows": [row(rtype, obj, now, include_object) for obj in objects],
    }
