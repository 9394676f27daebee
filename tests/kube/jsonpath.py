"""The JSONPath subset that CRDs use in printer columns and scale paths.

Supported: ``.a.b``, ``['a.b']``, ``[0]``, ``[-1]``, ``[*]``, and filters ``[?(@.type=="Ready")]`` with
``==``/``!=`` against a string, number or boolean literal; an optional ``{...}`` wrapper. Anything else
raises ``ValueError``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_FIELD = re.compile(r"\.([^.\[\]]+)")
_QUOTED = re.compile(r"\[\s*(['\"])(.*?)\1\s*\]")
_INDEX = re.compile(r"\[\s*(-?\d+|\*)\s*\]")
_FILTER = re.compile(r"\[\s*\?\(\s*@((?:\.[^.\s=!)]+)+)\s*(==|!=)\s*(\"[^\"]*\"|'[^']*'|[^\s)]+)\s*\)\s*\]")


@dataclass(frozen=True)
class Step:
    kind: str  # field | index | all | filter
    name: str = ""
    index: int = 0
    path: tuple[str, ...] = ()  # filter: the @-relative field path
    op: str = "=="
    value: Any = None


def _literal(text: str) -> Any:
    if text[:1] in ("'", '"'):
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse(path: str) -> list[Step]:
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    text = text.removeprefix("$")
    steps: list[Step] = []
    pos = 0
    while pos < len(text):
        if m := _FIELD.match(text, pos):
            steps.append(Step("field", name=m.group(1)))
        elif m := _QUOTED.match(text, pos):
            steps.append(Step("field", name=m.group(2)))
        elif m := _INDEX.match(text, pos):
            steps.append(Step("all") if m.group(1) == "*" else Step("index", index=int(m.group(1))))
        elif m := _FILTER.match(text, pos):
            steps.append(Step("filter", path=tuple(m.group(1).strip(".").split(".")), op=m.group(2),
                              value=_literal(m.group(3))))
        else:
            raise ValueError(f"unsupported JSONPath {path!r} at {text[pos:]!r}")
        pos = m.end()
    return steps


def _dig(node: Any, names: tuple[str, ...]) -> tuple[bool, Any]:
    for name in names:
        if not isinstance(node, dict) or name not in node:
            return False, None
        node = node[name]
    return True, node


def _apply(step: Step, node: Any) -> list[Any]:
    if step.kind == "field":
        return [node[step.name]] if isinstance(node, dict) and step.name in node else []
    if step.kind == "index":
        ok = isinstance(node, list) and -len(node) <= step.index < len(node)
        return [node[step.index]] if ok else []
    items = node if isinstance(node, list) else list(node.values()) if isinstance(node, dict) else []
    if step.kind == "all":
        return list(items)
    out = []
    for item in items:
        found, value = _dig(item, step.path)
        if found and (value == step.value) == (step.op == "=="):
            out.append(item)
    return out


def find(obj: Any, path: str) -> list[Any]:
    """All values at ``path`` in ``obj`` (empty when the path leads nowhere)."""
    nodes = [obj]
    for step in parse(path):
        nodes = [found for node in nodes for found in _apply(step, node)]
    return nodes


def first(obj: Any, path: str, default: Any = None) -> Any:
    values = find(obj, path)
    return values[0] if values else default


def set_field(obj: dict[str, Any], path: str, value: Any) -> None:
    """Set a plain field path (``.spec.replicas``) in place, creating the maps on the way."""
    steps = parse(path)
    if not steps or any(step.kind != "field" for step in steps):
        raise ValueError(f"not a plain field path: {path!r}")
    node = obj
    for step in steps[:-1]:
        node = node.setdefault(step.name, {})
    node[steps[-1].name] = value
